//! The CUDA C sources of the backend's kernels (`kernels/*.cu`, embedded in the binary) and their
//! compilation to PTX by NVRTC. Every source is compiled after the shared prelude
//! (`kernels/common.cuh`: bf16 conversions, strided indexing, fixed-order block reductions), and
//! the few CUDA headers a kernel includes ([`HEADERS`]) are embedded too and handed to NVRTC in
//! memory, so no CUDA toolkit headers or include paths are needed at run time.

use std::ffi::{c_char, c_int, CStr, CString};

/// One kernel source file.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// The file's stem (`elementwise`), which names its compiled module.
    pub name: &'static str,
    /// The CUDA C text, without the prelude.
    pub source: &'static str,
}

/// The prelude compiled before every source.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// The CUDA headers a kernel may `#include`, by name (`kernels/include/`): the parts of CUDA's
/// `<mma.h>` (`nvcuda::wmma` on 16×16×16 bf16/half tiles, with the `__nv_bfloat16` and `half`
/// types) and `<cuda_pipeline.h>` (cp.async) the kernels use, with CUDA's names, written over
/// NVRTC's builtins and inline PTX since NVRTC has no toolkit headers at run time. The CUDA
/// emulation (tools/cuda-emu/include/) has its own with the same names.
pub const HEADERS: &[(&str, &str)] = &[
    ("mma.h", include_str!("kernels/include/mma.h")),
    (
        "cuda_pipeline.h",
        include_str!("kernels/include/cuda_pipeline.h"),
    ),
];

/// Every kernel source of the backend.
pub const KERNELS: &[KernelSource] = &[
    KernelSource {
        name: "copy",
        source: include_str!("kernels/copy.cu"),
    },
    KernelSource {
        name: "elementwise",
        source: include_str!("kernels/elementwise.cu"),
    },
    KernelSource {
        name: "reduce",
        source: include_str!("kernels/reduce.cu"),
    },
    KernelSource {
        name: "softmax",
        source: include_str!("kernels/softmax.cu"),
    },
    KernelSource {
        name: "norm",
        source: include_str!("kernels/norm.cu"),
    },
    KernelSource {
        name: "rope",
        source: include_str!("kernels/rope.cu"),
    },
    KernelSource {
        name: "loss",
        source: include_str!("kernels/loss.cu"),
    },
    KernelSource {
        name: "embedding",
        source: include_str!("kernels/embedding.cu"),
    },
    KernelSource {
        name: "adamw",
        source: include_str!("kernels/adamw.cu"),
    },
    KernelSource {
        name: "attention",
        source: concat!(
            include_str!("kernels/attention.cuh"),
            include_str!("kernels/attention.cu")
        ),
    },
    KernelSource {
        name: "flash",
        source: concat!(
            include_str!("kernels/attention.cuh"),
            include_str!("kernels/flash.cu")
        ),
    },
    KernelSource {
        name: "flash_wmma",
        source: concat!(
            include_str!("kernels/attention.cuh"),
            include_str!("kernels/flash_wmma.cu")
        ),
    },
    KernelSource {
        name: "index",
        source: include_str!("kernels/index.cu"),
    },
    KernelSource {
        name: "moe",
        source: include_str!("kernels/moe.cu"),
    },
    KernelSource {
        name: "gemm",
        source: include_str!("kernels/gemm.cu"),
    },
    KernelSource {
        name: "wmma",
        source: include_str!("kernels/wmma.cu"),
    },
    KernelSource {
        name: "moe_gemm",
        source: include_str!("kernels/moe_gemm.cu"),
    },
    KernelSource {
        name: "delta_rule",
        source: include_str!("kernels/delta_rule.cu"),
    },
    KernelSource {
        name: "gathered_attention",
        source: include_str!("kernels/gathered_attention.cu"),
    },
];

/// The kernel source named `name`.
pub fn source(name: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|k| k.name == name)
}

/// Why a kernel did not compile.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// NVRTC itself cannot be loaded.
    #[error("NVRTC (libnvrtc.so) was not found: install the CUDA toolkit or the nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH")]
    NoNvrtc,
    /// NVRTC rejected the source: its log names the line.
    #[error("kernel {kernel} for {arch}: {log}")]
    Rejected {
        /// The source's name.
        kernel: &'static str,
        /// The target architecture (`sm_90`).
        arch: String,
        /// NVRTC's message.
        log: String,
    },
}

/// Compiles `kernel` (after the prelude, with [`HEADERS`] to include) to PTX for `arch`
/// (`sm_80`, `sm_90`). Floating-point options are pinned (IEEE division and square root, no
/// flush-to-zero) so results do not depend on NVRTC defaults.
pub fn compile_ptx(kernel: &KernelSource, arch: &str) -> Result<String, CompileError> {
    if !super::nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let src = format!("{COMMON}\n{}", kernel.source);
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--ftz=false".into(),
        "--prec-sqrt=true".into(),
        "--prec-div=true".into(),
        "--fmad=true".into(),
    ];
    nvrtc_compile(&src, &format!("{}.cu", kernel.name), &options).map_err(|log| {
        CompileError::Rejected {
            kernel: kernel.name,
            arch: arch.into(),
            log,
        }
    })
}

/// One NVRTC program: `src` named `name`, [`HEADERS`] in memory; its PTX, or NVRTC's log.
fn nvrtc_compile(src: &str, name: &str, options: &[String]) -> Result<String, String> {
    use cudarc::nvrtc::{result, sys};
    let c = |s: &str| CString::new(s).expect("kernel sources and headers hold no NUL byte");
    let (src, name) = (c(src), c(name));
    let bodies: Vec<CString> = HEADERS.iter().map(|(_, body)| c(body)).collect();
    let names: Vec<CString> = HEADERS.iter().map(|(n, _)| c(n)).collect();
    let body_ptrs: Vec<*const c_char> = bodies.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|s| s.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive for the whole program (NVRTC reads
    // them until the program is destroyed below), and the two arrays hold HEADERS.len() each.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as c_int,
            body_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| format!("creating the program: {e}"))?;
    // SAFETY (each call): `prog` was created above and is destroyed only after its last use.
    let ptx = match unsafe { result::compile_program(prog, options) } {
        Ok(()) => unsafe { result::get_ptx(prog) }
            .map_err(|e| format!("getting the PTX: {e}"))
            .map(|bytes| text(&bytes)),
        Err(e) => Err(unsafe { result::get_program_log(prog) }
            .map(|log| text(&log).trim().to_string())
            .unwrap_or_else(|_| format!("{e} (no log)"))),
    };
    // SAFETY: created above, not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    ptx
}

/// A NUL-terminated buffer from NVRTC as text.
fn text(bytes: &[c_char]) -> String {
    let bytes: &[u8] = bytemuck::cast_slice(bytes);
    CStr::from_bytes_until_nul(bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned())
}
