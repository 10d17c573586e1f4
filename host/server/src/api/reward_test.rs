//! Scoring sample inputs over the API, within a budget: `POST /api/rewards/{id}/test` with one
//! stored module, `POST /api/rewards/score` with several combined as an RL run combines them
//! (`anneal_reward::RewardSet`).
//!
//! Every call of a module is already limited (fuel and a deadline per call), but a request may
//! carry many inputs, so one request could keep a core busy for a long time. A request
//! therefore gets a total budget of fuel and wall time across its inputs (the server's
//! [`RewardTestBudget`]), each call gets at most what is left of it, and the inputs are capped in
//! number and bytes. The scoring runs on a blocking thread that checks, between inputs, whether
//! the client has gone (the handler's future was dropped) or the server is shutting down; the
//! call in flight then ends within its own deadline.

use super::configs::RewardPick;
use super::rewards::{find_reward, load_stored};
use super::{ApiError, ApiResult};
use crate::{AppState, RewardTestBudget};
use anneal_reward::{CallError, CallLimits, MemberSpec, RewardSet, ScoreInput};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// At most this many inputs per request.
pub const MAX_INPUTS: usize = 1000;
/// The largest request body (all inputs together, as JSON).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// The request body: `{"inputs":[{"prompt":..,"completion":..,"metadata":{..}}]}`.
#[derive(Deserialize)]
pub struct TestRequest {
    inputs: Vec<ScoreInput>,
}

/// Sets the flag when dropped: the handler's future is dropped when the client disconnects.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The body as JSON, or the documented error (a clear 413 for too many bytes).
fn parse_body<T>(body: Result<Json<T>, JsonRejection>) -> ApiResult<T> {
    body.map(|Json(b)| b).map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the inputs are larger than {MAX_BODY_BYTES} bytes of JSON; send fewer or \
                 shorter ones"
            ),
        ),
        status => ApiError::new(status, super::error::one_line(&e.body_text())),
    })
}

fn check_count(inputs: &[ScoreInput]) -> ApiResult<()> {
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(ApiError::bad_request(format!(
            "send between 1 and {MAX_INPUTS} inputs"
        )));
    }
    Ok(())
}

/// Runs `work` on a blocking thread with a `stopped` check that turns true when the client
/// disconnects (this future is dropped) or the server is shutting down.
async fn blocking_scoring(
    state: Arc<AppState>,
    work: impl FnOnce(&AppState, &dyn Fn() -> bool) -> ApiResult<Value> + Send + 'static,
) -> ApiResult<Json<Value>> {
    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancel));
    tokio::task::spawn_blocking(move || {
        let stopped = || cancel.load(Ordering::Relaxed) || state.shutting_down();
        work(&state, &stopped).map(Json)
    })
    .await
    .map_err(|e| ApiError::internal(format!("scoring failed: {e}")))?
}

/// Scores each input with the module: per input the score or the error kind and message, the
/// reward, details, fuel and microseconds (as `anneal reward test` prints them). A request that
/// runs out of its budget is a `422` with the results so far.
pub async fn test(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Json<TestRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let request = parse_body(body)?;
    let reward = find_reward(&state, &id)?;
    check_count(&request.inputs)?;
    let budget = state.options.reward_test;
    blocking_scoring(state, move |state, stopped| {
        let module = load_stored(state, &reward)?;
        let sandbox = state.sandbox()?;
        let per_call = sandbox.config().call_limits();
        score_all(
            per_call,
            &request.inputs,
            budget,
            stopped,
            &|input, limits| {
                let outcome = sandbox.score_within(&module, input, limits);
                let cut = outcome
                    .result
                    .as_ref()
                    .err()
                    .and_then(|e| budget_cut(e, limits, per_call));
                (outcome.to_json(), outcome.fuel_used, cut)
            },
        )
    })
    .await
}

/// `POST /api/rewards/score` body: modules with weights, the reward of a failed call, inputs.
#[derive(Deserialize)]
pub struct ScoreRequest {
    rewards: Vec<RewardPick>,
    #[serde(default)]
    error_reward: f64,
    inputs: Vec<ScoreInput>,
}

/// Scores each input with several modules combined by the RL rule (`RewardSet`): per input the
/// combined `reward`, `correct` and each module's part; within the same budget as a test.
pub async fn score(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ScoreRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let request = parse_body(body)?;
    check_count(&request.inputs)?;
    if request.rewards.is_empty() {
        return Err(ApiError::bad_request(
            "pick at least one reward module: \"rewards\":[{\"id\":1,\"weight\":1.0}]",
        ));
    }
    if !request.error_reward.is_finite() {
        return Err(ApiError::bad_request(
            "error_reward must be a finite number",
        ));
    }
    let mut specs = Vec::with_capacity(request.rewards.len());
    for pick in &request.rewards {
        let reward = find_reward(&state, &pick.id.to_string())?;
        specs.push(MemberSpec {
            path: state.stored_reward_path(&reward),
            name: reward.name,
            weight: pick.weight,
        });
    }
    let budget = state.options.reward_test;
    blocking_scoring(state, move |state, stopped| {
        let set = RewardSet::load(Arc::clone(state.sandbox()?), &specs, request.error_reward)
            .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
        let per_call = set.sandbox().config().call_limits();
        score_all(
            per_call,
            &request.inputs,
            budget,
            stopped,
            &|input, limits| {
                let combined = set.score_within(input, limits);
                let cut = combined
                    .errors()
                    .find_map(|(_, e)| budget_cut(e, limits, per_call));
                let fuel = combined.modules.iter().map(|m| m.fuel_used).sum();
                (combined.to_json(), fuel, cut)
            },
        )
    })
    .await
}

/// Why scoring stopped before the last input.
enum Cut {
    Fuel,
    Time,
}

/// A call stopped by what was left of the budget (`limits` below the per-call limits) rather
/// than by the per-call limits themselves: its error is the budget's, not the module's.
fn budget_cut(e: &CallError, limits: CallLimits, per_call: CallLimits) -> Option<Cut> {
    match e {
        CallError::FuelExhausted { .. } if limits.fuel < per_call.fuel => Some(Cut::Fuel),
        CallError::Timeout { .. } if limits.timeout < per_call.timeout => Some(Cut::Time),
        _ => None,
    }
}

/// What scoring one input gave: its JSON, the fuel it used, and whether the budget cut it.
type OneScore = (Value, u64, Option<Cut>);

/// Scores the inputs in order with `score_one` within `budget`, giving each input at most the
/// per-call limits and what is left of the budget, and checking `stopped` before each one.
fn score_all(
    per_call: CallLimits,
    inputs: &[ScoreInput],
    budget: RewardTestBudget,
    stopped: &dyn Fn() -> bool,
    score_one: &dyn Fn(&ScoreInput, CallLimits) -> OneScore,
) -> ApiResult<Value> {
    let start = Instant::now();
    let mut fuel_left = budget.fuel;
    let mut results = Vec::with_capacity(inputs.len());
    let mut cut = None;
    for input in inputs {
        if stopped() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the reward test was stopped: the client went away or the server is stopping",
            ));
        }
        let time_left = budget.time.saturating_sub(start.elapsed());
        if fuel_left == 0 {
            cut = Some(Cut::Fuel);
        } else if time_left.is_zero() {
            cut = Some(Cut::Time);
        }
        if cut.is_some() {
            break;
        }
        let limits = CallLimits {
            fuel: per_call.fuel.min(fuel_left),
            timeout: per_call.timeout.min(time_left),
        };
        let (json, fuel_used, input_cut) = score_one(input, limits);
        fuel_left = fuel_left.saturating_sub(fuel_used);
        cut = input_cut;
        results.push(json);
        if cut.is_some() {
            break;
        }
    }
    let Some(cut) = cut else {
        return Ok(json!({ "results": results }));
    };
    let what = match cut {
        Cut::Fuel => format!("{} fuel (--reward-test-fuel)", budget.fuel),
        Cut::Time => format!("{} s (--reward-test-seconds)", budget.time.as_secs_f64()),
    };
    Err(ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!(
            "the reward test used up its budget of {what} after {} of {} inputs; send fewer \
             inputs",
            results.len(),
            inputs.len()
        ),
    )
    .with("results", json!(results)))
}
