//! Scoring batches in parallel: worker threads take inputs one at a time from a shared counter,
//! so one slow or failing call never holds up or affects the others.

use crate::call::{ScoreInput, ScoreOutcome};
use crate::module::RewardModule;
use crate::sandbox::Sandbox;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

impl Sandbox {
    /// The number of worker threads [`Sandbox::score_batch`] uses.
    pub fn threads(&self) -> usize {
        match self.config.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    /// Scores every input with `module`, in parallel, each call in its own fresh store.
    /// The outcomes come back in the order of `inputs`.
    pub fn score_batch(&self, module: &RewardModule, inputs: &[ScoreInput]) -> Vec<ScoreOutcome> {
        let jobs: Vec<(&RewardModule, &ScoreInput)> = inputs.iter().map(|i| (module, i)).collect();
        self.score_jobs(&jobs)
    }

    /// Scores `(module, input)` pairs in parallel (e.g. a batch mixing tasks with different
    /// reward modules). The outcomes come back in the order of `jobs`.
    pub fn score_jobs(&self, jobs: &[(&RewardModule, &ScoreInput)]) -> Vec<ScoreOutcome> {
        let workers = self.threads().min(jobs.len());
        if workers <= 1 {
            return jobs.iter().map(|(m, i)| self.score(m, i)).collect();
        }
        let next = AtomicUsize::new(0);
        let slots: Vec<Mutex<Option<ScoreOutcome>>> =
            jobs.iter().map(|_| Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((module, input)) = jobs.get(i) else {
                        break;
                    };
                    let outcome = self.score(module, input);
                    *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
                });
            }
        });
        slots
            .into_iter()
            .map(|slot| {
                slot.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .expect("every slot is filled: each index below jobs.len() is taken once")
            })
            .collect()
    }
}
