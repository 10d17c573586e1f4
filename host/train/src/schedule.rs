//! Learning-rate schedules: linear warmup, then constant, cosine, linear or warmup-stable-decay.

use anneal_config::{Decay, LrScheduler};

/// The learning rate at every step of a run.
#[derive(Clone, Debug)]
pub struct LrSchedule {
    peak: f64,
    warmup: u64,
    total: u64,
    decay: Decay,
    min_ratio: f64,
    decay_fraction: f64,
}

impl LrSchedule {
    /// The schedule of a run of `total` steps peaking at `peak`.
    pub fn new(peak: f64, total: u64, cfg: &LrScheduler) -> Self {
        LrSchedule {
            peak,
            warmup: cfg.warmup_steps.min(total),
            total,
            decay: cfg.decay,
            min_ratio: cfg.min_lr_ratio,
            decay_fraction: cfg.decay_fraction,
        }
    }

    /// The learning rate of step `step` (counting from 1).
    pub fn lr(&self, step: u64) -> f64 {
        let step = step.clamp(1, self.total.max(1));
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        let floor = self.peak * self.min_ratio;
        // Progress through the decay phase, 0 at its first step and 1 at the last step.
        let progress = |start: u64| {
            let span = self.total.saturating_sub(start).max(1);
            (step.saturating_sub(start)) as f64 / span as f64
        };
        match self.decay {
            Decay::Constant => self.peak,
            Decay::Linear => {
                let p = progress(self.warmup);
                self.peak + (floor - self.peak) * p
            }
            Decay::Cosine => {
                let p = progress(self.warmup);
                floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            Decay::Wsd => {
                let decay_steps = (self.total as f64 * self.decay_fraction).round() as u64;
                let start = self.total.saturating_sub(decay_steps).max(self.warmup);
                if step <= start {
                    self.peak
                } else {
                    self.peak + (floor - self.peak) * progress(start)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(decay: Decay) -> LrSchedule {
        let cfg = LrScheduler {
            warmup_steps: 10,
            decay,
            min_lr_ratio: 0.1,
            decay_fraction: 0.2,
        };
        LrSchedule::new(1.0, 110, &cfg)
    }

    #[test]
    fn warmup_is_linear_from_zero() {
        let s = sched(Decay::Cosine);
        assert_eq!(s.lr(1), 0.1);
        assert_eq!(s.lr(5), 0.5);
        assert_eq!(s.lr(10), 1.0);
    }

    #[test]
    fn decays_end_at_the_floor() {
        for d in [Decay::Cosine, Decay::Linear, Decay::Wsd] {
            let s = sched(d);
            assert!((s.lr(110) - 0.1).abs() < 1e-12, "{d:?}: {}", s.lr(110));
            for step in 11..110 {
                assert!(
                    s.lr(step + 1) <= s.lr(step) + 1e-15,
                    "{d:?} rises at {step}"
                );
            }
        }
        assert_eq!(sched(Decay::Constant).lr(110), 1.0);
    }

    #[test]
    fn cosine_and_linear_midpoints() {
        // Decay covers steps 10..=110; step 60 is halfway.
        assert!((sched(Decay::Cosine).lr(60) - 0.55).abs() < 1e-12);
        assert!((sched(Decay::Linear).lr(60) - 0.55).abs() < 1e-12);
    }

    #[test]
    fn wsd_holds_then_decays_over_the_last_fraction() {
        let s = sched(Decay::Wsd);
        assert_eq!(s.lr(88), 1.0);
        assert!(s.lr(89) < 1.0);
        assert!((s.lr(99) - 0.55).abs() < 1e-12);
    }
}
