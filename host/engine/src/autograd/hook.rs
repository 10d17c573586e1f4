//! An identity op whose backward first calls a function: how a caller learns that the backward
//! is about to enter the part of the graph behind a tensor (FSDP gathers a block's parameters
//! again there, after freeing them when its forward ended).

use super::record;
use crate::error::Result;
use crate::tensor::Tensor;
use std::sync::Arc;

/// What [`before_backward`] calls.
pub type BeforeBackwardFn = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// `t` itself (sharing its storage), recorded so that backward calls `f` when the gradient
/// reaches it, before passing that gradient on unchanged. Without grad mode, or for a tensor
/// that does not require grad, it is `t` and `f` is never called.
pub fn before_backward(t: &Tensor, f: BeforeBackwardFn) -> Tensor {
    record("before_backward", t.detach(), &[t], move || {
        move |g: &Tensor| {
            f()?;
            Ok(vec![Some(g.clone())])
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn calls_before_the_gradient_moves_on_and_passes_it_unchanged() {
        let w = Tensor::from_slice(&[1.0f32, 2.0], &[2])
            .unwrap()
            .requires_grad_();
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let y = w.mul_scalar(3.0).unwrap();
        let w_seen = w.clone();
        let y = before_backward(
            &y,
            Arc::new(move || {
                // The op behind `y` has not run yet: the leaf has no gradient.
                assert!(w_seen.grad().is_none());
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }),
        );
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(w.grad().unwrap().to_vec::<f32>(), [3.0, 3.0]);
    }

    #[test]
    fn without_grad_it_is_the_tensor() {
        let x = Tensor::ones(&[2], DType::F32);
        let y = before_backward(&x, Arc::new(|| Ok(())));
        assert!(!y.requires_grad());
        assert!(y.shares_storage_with(&x));
    }
}
