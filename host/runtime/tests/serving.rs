//! The continuous-batching decode loop with the real Llama plugin: requests that join a running
//! batch mid-way decode exactly as they would alone (and as `infer::generate` does), stop
//! tokens and cancellation take rows out, and bad prompts are refused.

mod common;

use anneal_runtime::infer::{generate, Sampling};
use anneal_runtime::plugins::{Params, PluginModel};
use anneal_runtime::serving::{Event, Finish, Request, Scheduler, SchedulerOptions, ServingError};
use common::plugin;
use std::sync::Arc;

fn tiny_model() -> (Arc<PluginModel>, Params) {
    let args = serde_json::json!({
        "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
        "vocab_size": 96, "max_seq_len": 128
    });
    let inst = plugin("llama").create(Some("debugmodel"), &args).unwrap();
    let model = PluginModel::new("llama", inst).unwrap();
    let params = model.init_params(3).unwrap();
    (Arc::new(model), Arc::new(params))
}

fn request(prompt: Vec<i64>, max_new: usize, temperature: f32, seed: u64) -> Request {
    Request {
        prompt,
        max_new,
        sampling: Sampling {
            temperature,
            seed,
            ..Sampling::default()
        },
        stop_tokens: vec![],
        top_logprobs: 0,
        images: None,
    }
}

/// Tokens and logprob bits of a finished request's events.
fn collect(rx: std::sync::mpsc::Receiver<Event>) -> (Vec<i64>, Vec<u32>, Finish) {
    let (mut ids, mut lps) = (vec![], vec![]);
    for e in rx {
        match e {
            Event::Token(t) => {
                ids.push(t.id);
                lps.push(t.logprob.to_bits());
            }
            Event::Done(f) => return (ids, lps, f),
            Event::Failed(m) => panic!("request failed: {m}"),
        }
    }
    panic!("the channel closed before the request finished")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn requests_joining_a_running_batch_decode_as_they_would_alone() {
    let (model, params) = tiny_model();
    let sched =
        Scheduler::start(model.clone(), params.clone(), SchedulerOptions::default()).unwrap();
    let target = request(vec![5, 17, 3, 9, 22], 12, 0.0, 0);
    let alone = sched.complete(target.clone()).unwrap();
    let reference = generate(&model, &params, &target.prompt, 12, &target.sampling).unwrap();
    assert_eq!(alone.generation.tokens, reference.tokens);
    assert_eq!(bits(&alone.generation.logprobs), bits(&reference.logprobs));
    assert_eq!(alone.finish, Finish::Length);

    // Seven long requests start first; the target and eight more (some of the target's length,
    // so they share its prefill; some sampled) join while those are mid-way.
    let prompt = |i: usize| {
        (0..1 + i % 9)
            .map(|j| ((i * 13 + j * 7) % 96) as i64)
            .collect()
    };
    let early: Vec<Request> = (0..7)
        .map(|i| request(prompt(i), 30, if i % 2 == 0 { 0.0 } else { 0.9 }, i as u64))
        .collect();
    let late: Vec<Request> = (7..15)
        .map(|i| {
            let p = if i % 3 == 0 {
                vec![40, 2, 8, 61, 11]
            } else {
                prompt(i)
            };
            request(p, 4 + i % 11, if i % 2 == 0 { 0.0 } else { 0.7 }, i as u64)
        })
        .collect();
    let mut early_rx = Vec::new();
    for r in &early {
        let rx = sched.submit_channel(r.clone()).unwrap();
        // Its first token means it is in the running batch.
        let first = rx.recv().unwrap();
        assert!(matches!(first, Event::Token(_)), "{first:?}");
        early_rx.push((r, first, rx));
    }
    let target_rx = sched.submit_channel(target.clone()).unwrap();
    let late_rx: Vec<_> = late
        .iter()
        .map(|r| (r, sched.submit_channel(r.clone()).unwrap()))
        .collect();
    let (ids, lps, finish) = collect(target_rx);
    assert_eq!(
        ids, alone.generation.tokens,
        "the target's tokens changed in a batch"
    );
    assert_eq!(lps, bits(&alone.generation.logprobs));
    assert_eq!(finish, Finish::Length);
    // Every other request, greedy or sampled, also equals its own solo decode.
    for (r, rx) in late_rx {
        let (ids, lps, _) = collect(rx);
        let solo = generate(&model, &params, &r.prompt, r.max_new, &r.sampling).unwrap();
        assert_eq!(ids, solo.tokens, "{:?}", r.prompt);
        assert_eq!(lps, bits(&solo.logprobs));
    }
    for (r, first, rx) in early_rx {
        let Event::Token(first) = first else {
            unreachable!()
        };
        let (mut ids, mut lps, _) = collect(rx);
        ids.insert(0, first.id);
        lps.insert(0, first.logprob.to_bits());
        let solo = generate(&model, &params, &r.prompt, r.max_new, &r.sampling).unwrap();
        assert_eq!(ids, solo.tokens, "{:?}", r.prompt);
        assert_eq!(lps, bits(&solo.logprobs));
    }
    let stats = sched.stats();
    println!("{stats:?}");
    assert!(
        stats.max_rows >= 9,
        "the late requests did not join: {stats:?}"
    );
    // The target's length group shares one prefill: fewer prefills than requests.
    assert!(stats.prefills < stats.requests, "{stats:?}");
}

#[test]
fn stop_tokens_cancellation_top_logprobs_and_bad_prompts() {
    let (model, params) = tiny_model();
    let sched = Scheduler::start(model, params, SchedulerOptions { max_batch: 4 }).unwrap();
    let base = request(vec![1, 2, 3], 10, 0.0, 0);
    let full = sched.complete(base.clone()).unwrap().generation.tokens;
    // A stop token ends the completion at its first occurrence, included.
    let stop = full[3];
    let cut = full.iter().position(|&t| t == stop).unwrap() + 1;
    let stopped = sched
        .complete(Request {
            stop_tokens: vec![stop],
            ..base.clone()
        })
        .unwrap();
    assert_eq!(stopped.generation.tokens, full[..cut]);
    assert_eq!(stopped.finish, Finish::Stop);
    // Top alternatives: sorted, and for greedy decoding the first is the chosen token.
    let rx = sched
        .submit_channel(Request {
            top_logprobs: 3,
            ..base.clone()
        })
        .unwrap();
    for e in rx {
        if let Event::Token(t) = e {
            assert_eq!(t.top.len(), 3);
            assert_eq!(t.top[0], (t.id, t.logprob));
            assert!(t.top[0].1 >= t.top[1].1 && t.top[1].1 >= t.top[2].1);
        }
    }
    // No tokens wanted: done at once.
    let none = sched
        .complete(Request {
            max_new: 0,
            ..base.clone()
        })
        .unwrap();
    assert!(none.generation.tokens.is_empty());
    assert_eq!(none.finish, Finish::Length);
    // Dropping the receiver takes the row out of the batch.
    let before = sched.stats().tokens;
    let rx = sched.submit_channel(request(vec![7], 500, 0.0, 0)).unwrap();
    assert!(matches!(rx.recv().unwrap(), Event::Token(_)));
    drop(rx);
    sched.complete(base.clone()).unwrap();
    let spent = sched.stats().tokens - before;
    assert!(
        spent < 100,
        "a cancelled request kept decoding: {spent} tokens"
    );
    // Refused before queueing.
    assert!(matches!(
        sched.submit_channel(request(vec![], 4, 0.0, 0)),
        Err(ServingError::EmptyPrompt)
    ));
    let err = sched
        .submit_channel(request(vec![1, 96], 4, 0.0, 0))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "token id 96 is outside the vocabulary (0..96)"
    );
}

#[test]
fn dropping_the_scheduler_fails_running_requests() {
    let (model, params) = tiny_model();
    let sched = Scheduler::start(model, params, SchedulerOptions::default()).unwrap();
    let rx = sched
        .submit_channel(request(vec![4, 4], 100_000, 0.0, 0))
        .unwrap();
    assert!(matches!(rx.recv().unwrap(), Event::Token(_)));
    drop(sched);
    let last = rx.into_iter().last().unwrap();
    assert_eq!(last, Event::Failed("the server is shutting down".into()));
}
