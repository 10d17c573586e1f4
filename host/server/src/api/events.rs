//! `GET /api/runs/{id}/events`: Server-Sent Events for one run. `status` events carry the run
//! (sent first, then on every change), `metric` events one metric row each (every row with
//! `step > since`, then new rows as the trainer appends them).

use super::{parse_id, ApiError, ApiResult};
use crate::files::Tail;
use crate::AppState;
use axum::extract::{Path, Query, State};
use axum::response::sse::{Event, KeepAlive, KeepAliveStream, Sse};
use serde::Deserialize;
use serde_json::Value;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// `?since=STEP`: skip rows the client already has.
#[derive(Deserialize)]
pub struct EventsQuery {
    since: Option<f64>,
}

/// How often the metrics file is checked for new rows.
const POLL: Duration = Duration::from_millis(400);

/// The event stream of one run.
pub async fn run_events(
    State(state): State<Arc<AppState>>,
    Path(raw): Path<String>,
    Query(q): Query<EventsQuery>,
) -> ApiResult<Sse<KeepAliveStream<ReceiverStream<Result<Event, Infallible>>>>> {
    let id = parse_id("run", &raw)?;
    let run = state
        .registry
        .run(id)?
        .ok_or_else(|| ApiError::not_found(format!("no run with id {id}")))?;
    let (tx, rx) = mpsc::channel(256);
    let mut changes = state.manager.subscribe();
    let mut tail = Tail::new(std::path::Path::new(&run.run_dir).join(crate::files::METRICS_FILE));
    tokio::spawn(async move {
        let status = |run: &crate::registry::Run| {
            let v = super::runs::run_json(run, false);
            Ok(Event::default().event("status").data(v.to_string()))
        };
        if tx.send(status(&run)).await.is_err() {
            return;
        }
        let mut ticker = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    if !send_rows(&tx, &mut tail, q.since).await || tx.is_closed() {
                        return;
                    }
                }
                change = changes.recv() => {
                    let change = match change {
                        Ok(c) => c,
                        // Missed changes: resend the current status below.
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                            crate::runs::StatusChange { id, status: run.status }
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    };
                    if change.id != id {
                        continue;
                    }
                    // Rows written just before the process ended go out before its status.
                    if !send_rows(&tx, &mut tail, q.since).await {
                        return;
                    }
                    match state.registry.run(id) {
                        Ok(Some(now)) => {
                            if tx.send(status(&now)).await.is_err() {
                                return;
                            }
                        }
                        // Deleted: nothing more to say.
                        _ => return,
                    }
                }
            }
        }
    });
    Ok(Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()))
}

/// Sends the rows completed since the last poll; false when the client has gone.
async fn send_rows(
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    tail: &mut Tail,
    since: Option<f64>,
) -> bool {
    for row in tail.poll() {
        let step = row.get("step").and_then(Value::as_f64);
        if matches!((since, step), (Some(s), Some(st)) if st <= s) {
            continue;
        }
        let event = Event::default()
            .event("metric")
            .data(Value::Object(row).to_string());
        if tx.send(Ok(event)).await.is_err() {
            return false;
        }
    }
    true
}
