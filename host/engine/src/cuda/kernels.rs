//! The CUDA C sources of the backend's kernels (`kernels/*.cu`, embedded in the binary) and their
//! compilation to PTX by NVRTC. Every source is compiled after the shared prelude
//! (`kernels/common.cuh`: bf16 conversions, strided indexing, fixed-order block reductions), so
//! no CUDA headers or include paths are needed at run time.

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

/// Compiles `kernel` (after the prelude) to PTX for `arch` (`sm_80`, `sm_90`). Floating-point
/// options are pinned (IEEE division and square root, no flush-to-zero) so results do not
/// depend on NVRTC defaults.
pub fn compile_ptx(kernel: &KernelSource, arch: &str) -> Result<String, CompileError> {
    if !super::nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let src = format!("{COMMON}\n{}", kernel.source);
    let opts = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(true),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some(format!("{}.cu", kernel.name)),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| CompileError::Rejected {
            kernel: kernel.name,
            arch: arch.into(),
            log: compile_log(e),
        })
}

/// NVRTC's log out of its error (the part that names the line and the problem).
fn compile_log(e: cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            log.to_string_lossy().trim().to_string()
        }
        other => format!("{other:?}"),
    }
}
