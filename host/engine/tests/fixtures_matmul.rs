//! Matrix products against PyTorch fixtures (regenerate with tests/reference/make_fixtures.py).

mod common;

use anneal_engine::io::load_safetensors;
use common::assert_close;

#[test]
fn matmul_matches_pytorch() {
    let f = load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/matmul.safetensors"
    ))
    .unwrap();
    let check = |name: &str, got: anneal_engine::Tensor| {
        let want = &f[&format!("{name}.out")];
        assert_eq!(got.shape(), want.shape(), "{name} shape");
        assert_close(name, &got.to_vec_f32(), &want.to_vec_f32(), 1e-4, 1e-4);
    };
    check("mm", f["mm.a"].matmul(&f["mm.b"]).unwrap());
    check("bmm", f["bmm.a"].matmul(&f["bmm.b"]).unwrap());
    check(
        "linear",
        f["linear.x"]
            .matmul(&f["linear.w"].transpose(0, 1).unwrap())
            .unwrap(),
    );
    check("bcast", f["bcast.a"].matmul(&f["bcast.b"]).unwrap());
}
