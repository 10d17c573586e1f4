//! `anneal info` says where CUDA stands: on a machine without it, which library or device is
//! missing (never a panic: cudarc would panic on a missing library if asked); with a GPU, the
//! device's name, memory and architecture.

use anneal_tests::cli as common;

use common::{anneal, ok};

#[test]
fn info_names_what_cuda_lacks_or_the_device_it_found() {
    let out = anneal().arg("info").output().expect("run anneal info");
    let stdout = ok(&out);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("cuda backend:"))
        .unwrap_or_else(|| panic!("no cuda backend line in:\n{stdout}"));
    if line.contains("unavailable") {
        assert!(
            [
                "was not found",
                "reports no GPU",
                "could not",
                "does not exist"
            ]
            .iter()
            .any(|why| line.contains(why)),
            "the reason should name what is missing: {line}"
        );
    } else {
        assert!(line.contains("sm_") && line.contains("GiB"), "{line}");
    }
}
