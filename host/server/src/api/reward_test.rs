//! `POST /api/rewards/{id}/test`: scores sample inputs with a stored module, within a budget.
//!
//! Every call of a module is already limited (fuel and a deadline per call), but a request may
//! carry many inputs, so one request could keep a core busy for a long time. A request
//! therefore gets a total budget of fuel and wall time across its inputs (the server's
//! [`RewardTestBudget`]), each call gets at most what is left of it, and the inputs are capped in
//! number and bytes. The scoring runs on a blocking thread that checks, between inputs, whether
//! the client has gone (the handler's future was dropped) or the server is shutting down; the
//! call in flight then ends within its own deadline.

use super::rewards::{find_reward, load_stored};
use super::{ApiError, ApiResult};
use crate::{AppState, RewardTestBudget};
use anneal_reward::{CallError, CallLimits, RewardModule, Sandbox, ScoreInput};
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

/// Scores each input with the module: per input the score or the error kind and message, the
/// reward, details, fuel and microseconds (as `anneal reward test` prints them). A request that
/// runs out of its budget is a `422` with the results so far.
pub async fn test(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Json<TestRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let Json(request) = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the inputs are larger than {MAX_BODY_BYTES} bytes of JSON; send fewer or \
                 shorter ones"
            ),
        ),
        status => ApiError::new(status, super::error::one_line(&e.body_text())),
    })?;
    let reward = find_reward(&state, &id)?;
    if request.inputs.is_empty() || request.inputs.len() > MAX_INPUTS {
        return Err(ApiError::bad_request(format!(
            "send between 1 and {MAX_INPUTS} inputs"
        )));
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancel));
    let budget = state.options.reward_test;
    tokio::task::spawn_blocking(move || {
        let module = load_stored(&state, &reward)?;
        let sandbox = state.sandbox()?;
        let stopped = || cancel.load(Ordering::Relaxed) || state.shutting_down();
        score_all(sandbox, &module, &request.inputs, budget, &stopped).map(Json)
    })
    .await
    .map_err(|e| ApiError::internal(format!("scoring failed: {e}")))?
}

/// Why scoring stopped before the last input.
enum Cut {
    Fuel,
    Time,
}

/// Scores the inputs in order within `budget`, checking `stopped` before each one.
fn score_all(
    sandbox: &Sandbox,
    module: &RewardModule,
    inputs: &[ScoreInput],
    budget: RewardTestBudget,
    stopped: &dyn Fn() -> bool,
) -> ApiResult<Value> {
    let per_call = sandbox.config().call_limits();
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
        let outcome = sandbox.score_within(module, input, limits);
        fuel_left = fuel_left.saturating_sub(outcome.fuel_used);
        // A call stopped by what was left of the budget (rather than by the per-call limits)
        // ends the test: its error is the budget's, not the module's.
        cut = match outcome.result {
            Err(CallError::FuelExhausted { .. }) if limits.fuel < per_call.fuel => Some(Cut::Fuel),
            Err(CallError::Timeout { .. }) if limits.timeout < per_call.timeout => Some(Cut::Time),
            _ => None,
        };
        results.push(outcome.to_json());
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
