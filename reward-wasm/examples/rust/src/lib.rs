//! The example reward in Rust: 1.0 when the last number in the completion equals
//! `metadata.answer`, plus 0.1 when the completion contains "Answer:".

use anneal_reward_sdk::{export_reward, json_field, Input, Reward};

/// The last number in `text`: the last run of ASCII digits, with inner '.' between digits and
/// a '-' right before it (a leading '.' is dropped).
fn last_number(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let end = b.iter().rposition(u8::is_ascii_digit)?;
    let mut start = end;
    while start > 0
        && (b[start - 1].is_ascii_digit() || (b[start - 1] == b'.' && b[start].is_ascii_digit()))
    {
        start -= 1;
    }
    if b[start] == b'.' {
        start += 1;
    }
    if start > 0 && b[start - 1] == b'-' {
        start -= 1;
    }
    Some(&text[start..=end])
}

fn reward(input: &Input) -> Reward {
    let correct = match (
        last_number(input.completion),
        json_field(input.metadata, "answer"),
    ) {
        (Some(got), Some(want)) => got == want,
        _ => false,
    };
    let bonus = if input.completion.contains("Answer:") {
        0.1
    } else {
        0.0
    };
    let score = if correct { 1.0 } else { 0.0 } + bonus;
    Reward::new(score).with_details(format!("{{\"correct\":{correct}}}"))
}

export_reward!(reward);
