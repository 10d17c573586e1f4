//! Several reward modules as one reward: the rule `anneal rl` trains on and `anneal serve`
//! applies when it checks or scores a combination.
//!
//! The rule, in one place:
//! - the reward is `Σ weight × r`, where `r` is the module's score, or the set's error reward when
//!   the call failed (trap, timeout, fuel, memory, bad output, ABI mismatch);
//! - the completion is **correct** when every module that reports a boolean `correct` detail
//!   says `true`; a module that reports nothing (or fails) does not vote, and with no vote at
//!   all correctness is unknown (`None`);
//! - every module's own score, reward, details and error travel with the result, so a sample
//!   can say which module failed and how.

use crate::call::{ScoreInput, ScoreOutcome};
use crate::config::CallLimits;
use crate::error::{CallError, ErrorKind, LoadError};
use crate::module::RewardModule;
use crate::sandbox::Sandbox;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One module of a set to load: where it is, what to call it, and its weight.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberSpec {
    /// The module file (`.wasm` binary or `.wat` text).
    pub path: PathBuf,
    /// The name results report; empty: the file name.
    pub name: String,
    /// The weight of its reward in the sum.
    pub weight: f64,
}

/// Why a set could not be built. Each error names the member by its position, so a caller can
/// point at the config key (`rl.rewards[<index>]`).
#[derive(Debug, thiserror::Error)]
pub enum SetError {
    /// No modules: a set must combine at least one.
    #[error("name at least one reward module")]
    Empty,
    /// A member's weight is NaN or infinite.
    #[error("reward module {index} ({path}): the weight {weight} is not a finite number")]
    Weight {
        /// The member's position.
        index: usize,
        /// Its file.
        path: PathBuf,
        /// The weight given.
        weight: f64,
    },
    /// A member could not be loaded (unreadable, not WebAssembly, disallowed imports).
    #[error("reward module {index}: {source}")]
    Load {
        /// The member's position.
        index: usize,
        /// Its file.
        path: PathBuf,
        /// Why.
        source: LoadError,
    },
    /// A member loads but does not export what the reward ABI requires (every call would fail).
    #[error("reward module {index} ({path}) does not match the reward ABI ({problem})")]
    Abi {
        /// The member's position.
        index: usize,
        /// Its file.
        path: PathBuf,
        /// What is missing or wrong.
        problem: String,
    },
}

impl SetError {
    /// The position of the member the error is about (`None` for [`SetError::Empty`]).
    pub fn index(&self) -> Option<usize> {
        match self {
            SetError::Empty => None,
            SetError::Weight { index, .. }
            | SetError::Load { index, .. }
            | SetError::Abi { index, .. } => Some(*index),
        }
    }
}

/// One loaded member.
#[derive(Clone, Debug)]
struct Member {
    name: String,
    module: RewardModule,
    weight: f64,
}

/// Reward modules with weights, scored together by one sandbox. `Send + Sync`: rollout workers
/// share one set.
pub struct RewardSet {
    sandbox: Arc<Sandbox>,
    members: Vec<Member>,
    error_reward: f64,
}

impl std::fmt::Debug for RewardSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardSet")
            .field("members", &self.members)
            .field("error_reward", &self.error_reward)
            .finish()
    }
}

/// What one module made of one completion, as part of a [`Combined`] result.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleScore {
    /// The member's name.
    pub name: String,
    /// Its weight in the sum.
    pub weight: f64,
    /// The module's score, or why the call failed.
    pub result: Result<f64, CallError>,
    /// What entered the sum (before the weight): the score, or the set's error reward.
    pub reward: f64,
    /// The module's boolean `correct` detail, when it reported one.
    pub correct: Option<bool>,
    /// All the details the module reported.
    pub details: Option<Map<String, Value>>,
    /// Fuel the call used.
    pub fuel_used: u64,
    /// Wall-clock microseconds of the call.
    pub micros: u64,
}

impl ModuleScore {
    /// The kind of the failure, when the call failed.
    pub fn error_kind(&self) -> Option<ErrorKind> {
        self.result.as_ref().err().map(CallError::kind)
    }

    /// As JSON: `name, weight, score` (null on failure), `reward, correct, error` (the kind or
    /// null), `message` (or null), `details`.
    pub fn to_json(&self) -> Value {
        let (score, error, message) = match &self.result {
            Ok(s) => (json!(s), Value::Null, Value::Null),
            Err(e) => (Value::Null, json!(e.kind()), json!(e.message())),
        };
        json!({
            "name": self.name,
            "weight": self.weight,
            "score": score,
            "reward": self.reward,
            "correct": self.correct,
            "error": error,
            "message": message,
            "details": self.details,
        })
    }
}

/// The combined reward of one completion and what each module contributed.
#[derive(Clone, Debug, PartialEq)]
pub struct Combined {
    /// `Σ weight × reward` over the modules.
    pub reward: f64,
    /// Whether every module that reported `correct` said `true` (`None`: none reported it).
    pub correct: Option<bool>,
    /// Each module's part, in the set's order.
    pub modules: Vec<ModuleScore>,
}

impl Combined {
    /// Applies the rule to the outcomes of one completion: `(name, weight, outcome)` per module,
    /// in order; a failed call counts as `error_reward`.
    pub fn combine(parts: Vec<(String, f64, ScoreOutcome)>, error_reward: f64) -> Combined {
        let mut combined = Combined {
            reward: 0.0,
            correct: None,
            modules: Vec::with_capacity(parts.len()),
        };
        for (name, weight, outcome) in parts {
            let reward = *outcome.result.as_ref().unwrap_or(&error_reward);
            let correct = outcome
                .details
                .as_ref()
                .and_then(|d| d.get("correct"))
                .and_then(Value::as_bool);
            combined.reward += weight * reward;
            if let Some(c) = correct {
                combined.correct = Some(combined.correct.unwrap_or(true) && c);
            }
            combined.modules.push(ModuleScore {
                name,
                weight,
                result: outcome.result,
                reward,
                correct,
                details: outcome.details,
                fuel_used: outcome.fuel_used,
                micros: outcome.micros,
            });
        }
        combined
    }

    /// The modules whose call failed, with the error.
    pub fn errors(&self) -> impl Iterator<Item = (&ModuleScore, &CallError)> {
        self.modules
            .iter()
            .filter_map(|m| m.result.as_ref().err().map(|e| (m, e)))
    }

    /// As JSON: `reward, correct, modules: [ModuleScore::to_json, ..]`.
    pub fn to_json(&self) -> Value {
        json!({
            "reward": self.reward,
            "correct": self.correct,
            "modules": self.modules.iter().map(ModuleScore::to_json).collect::<Vec<_>>(),
        })
    }
}

impl RewardSet {
    /// Loads every member with `sandbox` and checks it against the reward ABI. A failed call
    /// will count as `error_reward` (whatever the sandbox's own configuration says).
    pub fn load(
        sandbox: Arc<Sandbox>,
        specs: &[MemberSpec],
        error_reward: f64,
    ) -> Result<RewardSet, SetError> {
        if specs.is_empty() {
            return Err(SetError::Empty);
        }
        let mut members = Vec::with_capacity(specs.len());
        for (index, spec) in specs.iter().enumerate() {
            if !spec.weight.is_finite() {
                return Err(SetError::Weight {
                    index,
                    path: spec.path.clone(),
                    weight: spec.weight,
                });
            }
            let module = sandbox
                .load_file(&spec.path)
                .map_err(|source| SetError::Load {
                    index,
                    path: spec.path.clone(),
                    source,
                })?;
            if let Some(problem) = module.abi_problem() {
                return Err(SetError::Abi {
                    index,
                    path: spec.path.clone(),
                    problem: problem.to_string(),
                });
            }
            members.push(Member {
                name: member_name(spec),
                module,
                weight: spec.weight,
            });
        }
        Ok(RewardSet {
            sandbox,
            members,
            error_reward,
        })
    }

    /// [`RewardSet::score`] within `limits` for all the members together: each call gets the
    /// fuel and time the earlier members of this input left.
    pub fn score_within(&self, input: &ScoreInput, limits: CallLimits) -> Combined {
        let start = std::time::Instant::now();
        let mut fuel_left = limits.fuel;
        let parts = self
            .members
            .iter()
            .map(|m| {
                let call = CallLimits {
                    fuel: fuel_left,
                    timeout: limits.timeout.saturating_sub(start.elapsed()),
                };
                let outcome = self.sandbox.score_within(&m.module, input, call);
                fuel_left = fuel_left.saturating_sub(outcome.fuel_used);
                (m.name.clone(), m.weight, outcome)
            })
            .collect();
        Combined::combine(parts, self.error_reward)
    }

    /// Scores one completion with every member, in order, and combines the results.
    pub fn score(&self, input: &ScoreInput) -> Combined {
        let parts = self
            .members
            .iter()
            .map(|m| {
                (
                    m.name.clone(),
                    m.weight,
                    self.sandbox.score(&m.module, input),
                )
            })
            .collect();
        Combined::combine(parts, self.error_reward)
    }

    /// The members' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|m| m.name.as_str())
    }

    /// The reward a failed call counts as.
    pub fn error_reward(&self) -> f64 {
        self.error_reward
    }

    /// The sandbox the members run in (its counters cover every call).
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }
}

fn member_name(spec: &MemberSpec) -> String {
    if !spec.name.is_empty() {
        return spec.name.clone();
    }
    Path::new(&spec.path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| spec.path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(score: f64, details: Option<Value>) -> ScoreOutcome {
        ScoreOutcome {
            result: Ok(score),
            reward: score,
            details: details.and_then(|d| d.as_object().cloned()),
            fuel_used: 10,
            micros: 1,
        }
    }

    fn failed(error: CallError) -> ScoreOutcome {
        ScoreOutcome {
            result: Err(error),
            // The sandbox's own error reward: the set's rule replaces it.
            reward: 123.0,
            details: None,
            fuel_used: 0,
            micros: 1,
        }
    }

    fn part(name: &str, weight: f64, outcome: ScoreOutcome) -> (String, f64, ScoreOutcome) {
        (name.to_string(), weight, outcome)
    }

    #[test]
    fn rewards_are_weighted_sums_and_failures_count_as_the_error_reward() {
        let c = Combined::combine(
            vec![
                part("exact", 1.0, ok(1.0, None)),
                part("shape", 0.5, ok(0.6, None)),
                part(
                    "trap",
                    2.0,
                    failed(CallError::Trap {
                        message: "unreachable".into(),
                    }),
                ),
            ],
            -1.0,
        );
        assert_eq!(
            c.reward,
            1.0 + 0.5 * 0.6 - 2.0,
            "the trap counts as -1 at weight 2"
        );
        assert_eq!(c.modules.len(), 3);
        assert_eq!(c.modules[2].reward, -1.0);
        assert_eq!(c.modules[2].error_kind(), Some(ErrorKind::Trap));
        let errors: Vec<&str> = c.errors().map(|(m, _)| m.name.as_str()).collect();
        assert_eq!(errors, ["trap"]);
        let json = c.to_json();
        assert_eq!(json["modules"][2]["error"], "trap");
        assert_eq!(json["modules"][2]["score"], Value::Null);
        assert_eq!(json["modules"][1]["score"], 0.6);
    }

    #[test]
    fn correct_is_the_and_of_the_modules_that_report_it() {
        let yes = || Some(json!({"correct": true}));
        let no = || Some(json!({"correct": false}));
        let combine = |parts| Combined::combine(parts, 0.0).correct;
        // Nobody reports: unknown, however high the reward.
        assert_eq!(combine(vec![part("a", 1.0, ok(5.0, None))]), None);
        // Only the reporters vote; a non-boolean `correct` is no vote.
        assert_eq!(
            combine(vec![
                part("a", 1.0, ok(0.0, yes())),
                part("b", 1.0, ok(0.0, None)),
                part("c", 1.0, ok(0.0, Some(json!({"correct": 1})))),
            ]),
            Some(true)
        );
        assert_eq!(
            combine(vec![
                part("a", 1.0, ok(1.0, yes())),
                part("b", 1.0, ok(1.0, no()))
            ]),
            Some(false)
        );
        assert_eq!(
            combine(vec![
                part("a", 1.0, ok(1.0, no())),
                part("b", 1.0, ok(1.0, yes()))
            ]),
            Some(false)
        );
        // A failed call does not vote.
        assert_eq!(
            combine(vec![
                part("a", 1.0, ok(1.0, yes())),
                part("b", 1.0, failed(CallError::Timeout { timeout_ms: 5 })),
            ]),
            Some(true)
        );
    }

    #[test]
    fn sets_name_members_by_file_or_given_name_and_refuse_bad_specs() {
        let spec = |path: &str, name: &str| MemberSpec {
            path: path.into(),
            name: name.into(),
            weight: 1.0,
        };
        assert_eq!(member_name(&spec("a/b/exact.wat", "")), "exact.wat");
        assert_eq!(member_name(&spec("a/b/0123.wasm", "exact")), "exact");
        let sandbox = Arc::new(Sandbox::new(crate::SandboxConfig::default()).expect("sandbox"));
        assert!(matches!(
            RewardSet::load(sandbox.clone(), &[], 0.0),
            Err(SetError::Empty)
        ));
        let missing = RewardSet::load(sandbox.clone(), &[spec("/no/such/file.wasm", "")], 0.0)
            .expect_err("a missing file");
        assert_eq!(missing.index(), Some(0));
        let mut nan = spec("/no/such/file.wasm", "");
        nan.weight = f64::NAN;
        let e = RewardSet::load(sandbox, &[nan], 0.0).expect_err("a NaN weight");
        assert!(matches!(e, SetError::Weight { index: 0, .. }), "{e}");
    }
}
