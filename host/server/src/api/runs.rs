//! The run endpoints: list, create, show, stop, resume, delete, metrics, logs, checkpoints,
//! an RL run's samples, sampling from a checkpoint.

use super::configs::{Checked, ConfigRequest};
use super::{parse_id, ApiError, ApiResult};
use crate::registry::{NewRun, Run};
use crate::{files, process, AppState};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

fn find_run(state: &AppState, raw: &str) -> ApiResult<Run> {
    let id = parse_id("run", raw)?;
    state
        .registry
        .run(id)?
        .ok_or_else(|| ApiError::not_found(format!("no run with id {id}")))
}

/// The newest value of each headline metric (`step`, `loss`, `val_loss`, ...), read from the end
/// of the metrics file.
fn latest_metrics(run: &Run) -> Value {
    const KEYS: [&str; 8] = [
        "step",
        "loss",
        "val_loss",
        "tokens_per_s",
        "mfu",
        "reward_mean",
        "accuracy",
        "eval_accuracy",
    ];
    let path = PathBuf::from(&run.run_dir).join(files::METRICS_FILE);
    let Some(text) = files::tail_text(&path, 64 * 1024) else {
        return Value::Null;
    };
    let mut latest = serde_json::Map::new();
    for line in text.lines().rev() {
        let Ok(Value::Object(row)) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        for key in KEYS {
            if let (false, Some(v)) = (latest.contains_key(key), row.get(key)) {
                latest.insert(key.to_string(), v.clone());
            }
        }
        if latest.len() == KEYS.len() {
            break;
        }
    }
    Value::Object(latest)
}

/// The steps the run trains to (`training.steps` of the resolved `config.toml` the trainer
/// wrote in its run dir), or null before the trainer has written it.
fn total_steps(run: &Run) -> Value {
    let path = PathBuf::from(&run.run_dir).join("config.toml");
    let Some(text) = files::tail_text(&path, 1024 * 1024) else {
        return Value::Null;
    };
    let steps = text
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get("training")?.get("steps")?.as_integer());
    steps.map_or(Value::Null, Value::from)
}

/// The run as the API shows it: the record (without its config text unless `with_config`),
/// its latest metrics and its total steps.
pub(crate) fn run_json(run: &Run, with_config: bool) -> Value {
    let mut v = json!(run);
    if !with_config {
        if let Some(o) = v.as_object_mut() {
            o.remove("config");
        }
    }
    v["latest"] = latest_metrics(run);
    v["total_steps"] = total_steps(run);
    v
}

/// Every run, newest first (without config texts), each with its latest metrics.
pub async fn list(State(state): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let runs = state.registry.runs()?;
    Ok(Json(Value::Array(
        runs.iter().map(|r| run_json(r, false)).collect(),
    )))
}

/// One run, with its config text.
pub async fn show(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let run = find_run(&state, &id)?;
    Ok(Json(run_json(&run, true)))
}

/// `POST /api/runs` body.
#[derive(Deserialize)]
pub struct CreateRun {
    /// Display name (defaults to the config's file name).
    pub name: Option<String>,
    /// The config and overrides.
    #[serde(flatten)]
    pub config: ConfigRequest,
}

/// Validates the config, records a queued run (an RL run when the config has an `[rl]` section
/// or reward modules were picked) and starts it when a slot is free: `201 {"id":..}`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    Json(request): Json<CreateRun>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let (request, checked) = tokio::task::spawn_blocking({
        let state = Arc::clone(&state);
        move || {
            let checked = request.config.check(&state)?;
            Ok::<_, ApiError>((request, checked))
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("validation failed: {e}")))??;
    let Checked {
        text,
        path,
        overrides,
        kind,
        ..
    } = checked;
    let name = match request.name.as_deref().map(str::trim) {
        Some(n) if !n.is_empty() => n.chars().take(200).collect(),
        _ => path
            .as_deref()
            .and_then(|p| p.rsplit('/').next())
            .map(|f| f.trim_end_matches(".toml").to_string())
            .unwrap_or_else(|| "run".into()),
    };
    let runs_dir = state.manager.launch().runs_dir.clone();
    let run = state.registry.create_run(
        &NewRun {
            name: &name,
            kind: kind.as_str(),
            config_path: path.as_deref(),
            config: &text,
            overrides: &overrides,
        },
        &runs_dir,
    )?;
    let run_dir = PathBuf::from(&run.run_dir);
    std::fs::create_dir_all(&run_dir)
        .and_then(|()| std::fs::write(process::source_file(&run_dir), &text))
        .map_err(|e| ApiError::internal(format!("cannot write {}: {e}", run_dir.display())))?;
    state.manager.queued(run.id);
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": run.id, "run": run_json(&run, false) })),
    ))
}

/// `?force=true` kills instead of asking.
#[derive(Deserialize)]
pub struct StopQuery {
    #[serde(default)]
    force: bool,
}

/// Asks a run to stop (graceful: the trainer saves a checkpoint first): `202` with the run.
pub async fn stop(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<StopQuery>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let id = parse_id("run", &id)?;
    let run = state.manager.stop(id, q.force)?;
    Ok((StatusCode::ACCEPTED, Json(run_json(&run, false))))
}

/// Starts a stopped or failed run again in its run dir: `202` with the run; `409` for an
/// active or completed one.
pub async fn resume(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let id = parse_id("run", &id)?;
    let run = state.manager.resume(id)?;
    Ok((StatusCode::ACCEPTED, Json(run_json(&run, false))))
}

/// Deletes a run without a process, and its run directory: `204`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = parse_id("run", &id)?;
    state.manager.delete(id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `?since=STEP&fields=loss,lr&max_points=N`.
#[derive(Deserialize)]
pub struct MetricsQuery {
    since: Option<f64>,
    fields: Option<String>,
    max_points: Option<usize>,
}

/// Metric rows with `step > since` (all without `since`), optionally only some fields and at
/// most `max_points` rows (evenly spaced).
pub async fn metrics(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<MetricsQuery>,
) -> ApiResult<Json<Value>> {
    let run = find_run(&state, &id)?;
    let rows = tokio::task::spawn_blocking(move || {
        let mut rows = files::read_metrics(std::path::Path::new(&run.run_dir), q.since);
        if let Some(fields) = q.fields.as_deref() {
            let fields: Vec<&str> = fields.split(',').map(str::trim).collect();
            rows = files::select_fields(rows, &fields);
        }
        if let Some(max) = q.max_points {
            rows = files::downsample(rows, max);
        }
        rows
    })
    .await
    .map_err(|e| ApiError::internal(format!("reading metrics failed: {e}")))?;
    Ok(Json(json!(rows)))
}

/// `?tail=N`.
#[derive(Deserialize)]
pub struct LogsQuery {
    tail: Option<usize>,
    /// The rank whose log to read: 0 (the default) is the run's log, which rank 0 writes to;
    /// another rank of a multi-process run writes `logs/rank-<r>.log`.
    rank: Option<usize>,
}

/// The last `tail` (default 200, at most 10000) lines of the run's log (or of rank `rank`'s),
/// and `ranks`: the ranks that have a log (`[0]` for a single process).
pub async fn logs(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<LogsQuery>,
) -> ApiResult<Json<Value>> {
    let run = find_run(&state, &id)?;
    let n = q.tail.unwrap_or(200).min(10_000);
    let run_dir = PathBuf::from(&run.run_dir);
    let ranks = files::rank_logs(&run_dir);
    let path = match q.rank.unwrap_or(0) {
        0 => run_dir.join(process::LOG_FILE),
        r if ranks.contains(&r) => files::rank_log(&run_dir, r),
        r => {
            return Err(ApiError::not_found(format!(
                "run {id} has no log of rank {r} (ranks: {ranks:?})"
            )))
        }
    };
    let lines = files::tail_lines(&path, n);
    Ok(Json(json!({ "lines": lines, "ranks": ranks })))
}

/// The run's finished checkpoints, oldest first.
pub async fn checkpoints(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let run = find_run(&state, &id)?;
    Ok(Json(json!(files::checkpoints(std::path::Path::new(
        &run.run_dir
    )))))
}

/// A page of an RL run's samples (`samples.jsonl`), newest step first, filtered by step, failed
/// (not correct, or a reward below `threshold`) and erroring (a reward module's call failed).
/// At most [`crate::samples::MAX_READERS`] requests read at once; each reads only the lines
/// appended since the last request and those of its page.
pub async fn samples(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<crate::samples::Query>,
) -> ApiResult<Json<crate::samples::Page>> {
    let run = find_run(&state, &id)?;
    if q.threshold.is_some_and(|t| !t.is_finite()) {
        return Err(ApiError::bad_request("threshold must be a finite number"));
    }
    let _turn = state.samples.turn().await;
    let reader = Arc::clone(&state);
    let page = tokio::task::spawn_blocking(move || {
        reader
            .samples
            .read(std::path::Path::new(&run.run_dir), &q)
            .map_err(|e| format!("reading the samples of run {} failed: {e}", run.id))
    })
    .await
    .map_err(|e| ApiError::internal(format!("reading samples failed: {e}")))?
    .map_err(ApiError::internal)?;
    Ok(Json(page))
}

/// `POST /api/runs/{id}/generate` body.
#[derive(Deserialize)]
pub struct GenerateRequest {
    prompt: Option<String>,
    prompt_tokens: Option<Vec<i64>>,
    #[serde(default = "default_new_tokens")]
    max_new_tokens: usize,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "one")]
    top_p: f32,
    #[serde(default)]
    top_k: usize,
    #[serde(default)]
    seed: u64,
}

fn default_new_tokens() -> usize {
    32
}

fn one() -> f32 {
    1.0
}

/// Samples from the run's newest checkpoint: exports it once as a Hugging Face directory
/// (`<run_dir>/hf/step-<N>/`, the same as `anneal checkpoint export --to-hf`) and runs
/// `anneal generate` on it. A run without checkpoints is a `409`.
pub async fn generate(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Json(request): Json<GenerateRequest>,
) -> ApiResult<Json<Value>> {
    let run = find_run(&state, &id)?;
    let run_dir = PathBuf::from(&run.run_dir);
    let Some(newest) = files::checkpoints(&run_dir).pop() else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("run {} has no checkpoint yet; sampling needs one", run.id),
        ));
    };
    let dir = tokio::task::spawn_blocking({
        let run_dir = run_dir.clone();
        let name = newest.name.clone();
        move || export_for_sampling(&run_dir, &name)
    })
    .await
    .map_err(|e| ApiError::internal(format!("export failed: {e}")))??;
    let mut cmd = tokio::process::Command::new(&state.manager.launch().exe);
    // Every value goes in `--flag=value` form: a prompt such as "-1 is" must stay the prompt,
    // never become a flag of `anneal generate`.
    cmd.arg("generate")
        .arg(process::flag("--model-dir", dir.as_os_str()));
    match (&request.prompt, &request.prompt_tokens) {
        (Some(text), None) => {
            let tokenizer = [dir.join("tokenizer.json"), run_dir.join("tokenizer.json")]
                .into_iter()
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "this checkpoint has no tokenizer.json; send prompt_tokens instead",
                    )
                })?;
            cmd.arg(process::flag("--prompt", text.as_ref()))
                .arg(process::flag("--tokenizer", tokenizer.as_os_str()));
        }
        (None, Some(tokens)) if !tokens.is_empty() => {
            let ids: Vec<String> = tokens.iter().map(i64::to_string).collect();
            cmd.arg(process::flag("--prompt-tokens", ids.join(",").as_ref()));
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of \"prompt\" (text) and \"prompt_tokens\" (a non-empty list)",
            ))
        }
    }
    let numbers = [
        (
            "--max-new-tokens",
            request.max_new_tokens.min(4096).to_string(),
        ),
        ("--temperature", request.temperature.to_string()),
        ("--top-p", request.top_p.to_string()),
        ("--top-k", request.top_k.to_string()),
        ("--seed", request.seed.to_string()),
    ];
    for (name, value) in numbers {
        cmd.arg(process::flag(name, value.as_ref()));
    }
    cmd.kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .map_err(|_| ApiError::internal("sampling took longer than 300 s"))?
        .map_err(|e| ApiError::internal(format!("cannot run anneal generate: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            err.lines()
                .last()
                .unwrap_or("anneal generate failed")
                .to_string(),
        ));
    }
    let mut value: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| ApiError::internal(format!("anneal generate printed no JSON: {e}")))?;
    value["checkpoint"] = json!(newest.name);
    Ok(Json(value))
}

/// The Hugging Face export of checkpoint `name` of a run, made on first use. Written to a
/// temporary folder and renamed, so a concurrent or interrupted export is never half-read.
fn export_for_sampling(run_dir: &std::path::Path, name: &str) -> ApiResult<PathBuf> {
    let out = run_dir.join("hf").join(name);
    if out.join("config.json").is_file() {
        return Ok(out);
    }
    let tmp = run_dir
        .join("hf")
        .join(format!("{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let step_dir = run_dir.join("checkpoints").join(name);
    anneal_train::checkpoint::export_hf(&step_dir, &tmp, true).map_err(|e| {
        let _ = std::fs::remove_dir_all(&tmp);
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("cannot export {name} for sampling: {e}"),
        )
    })?;
    match std::fs::rename(&tmp, &out) {
        Ok(()) => Ok(out),
        // Another request exported it first.
        Err(_) if out.join("config.json").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(out)
        }
        Err(e) => Err(ApiError::internal(format!(
            "cannot move the export into {}: {e}",
            out.display()
        ))),
    }
}
