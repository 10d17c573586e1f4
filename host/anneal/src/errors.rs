//! How the CLI reports an error: one line with each cause once, and an exit code that tells a
//! script whose problem it is: 2 when the user's input (arguments, config, files, plugins they
//! named) must change, 1 when the run itself failed (IO, a plugin bug, a non-finite loss).

use anneal_train::checkpoint::CheckpointError;

/// A problem with what the user asked for, found by the CLI itself: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UserError(pub String);

/// Returns early with a [`UserError`] built like `format!`.
#[macro_export]
macro_rules! user_bail {
    ($($arg:tt)*) => {
        return Err($crate::errors::UserError(format!($($arg)*)).into())
    };
}

/// The error and its causes on one line: `context: cause: root`, skipping a cause whose text the
/// line already holds (error types that print their source as well as returning it would
/// otherwise say `X: X`), with any line breaks inside a message folded into spaces.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause
            .to_string()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// 2 for the user's input, 1 for a failure of the run: decided by the outermost error in the
/// chain whose type says which it is. Anything unclassified is a failure, so a bug or an IO
/// error never tells the user to fix their input.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        if let Some(user) = classify(cause) {
            return if user { 2 } else { 1 };
        }
    }
    1
}

/// `Some(true)` for a user error, `Some(false)` for a failure, `None` when the type does not say.
fn classify(e: &(dyn std::error::Error + 'static)) -> Option<bool> {
    if e.is::<UserError>()
        || e.is::<anneal_config::ConfigError>()
        || e.is::<anneal_runtime::hf::HfError>()
        || e.is::<anneal_runtime::infer::RequestError>()
        || e.is::<anneal_data::DataError>()
    {
        return Some(true);
    }
    if let Some(p) = e.downcast_ref::<anneal_runtime::plugins::PluginError>() {
        return Some(p.is_user_error());
    }
    if let Some(t) = e.downcast_ref::<anneal_train::TrainError>() {
        return Some(t.is_user_error());
    }
    if let Some(s) = e.downcast_ref::<anneal_server::ServeError>() {
        use anneal_server::ServeError as S;
        // The address, token, home and models are what the user chose; a registry or run that
        // cannot be opened or reconciled is the server's failure.
        return Some(matches!(
            s,
            S::NeedsToken(_) | S::Bind { .. } | S::Home { .. } | S::HomeInUse(_) | S::Model(_)
        ));
    }
    if let Some(set) = e.downcast_ref::<anneal_reward::SetError>() {
        // A module that cannot be loaded says which way itself (its source is a LoadError).
        if !matches!(set, anneal_reward::SetError::Load { .. }) {
            return Some(true);
        }
    }
    if let Some(l) = e.downcast_ref::<anneal_reward::LoadError>() {
        return Some(!matches!(l, anneal_reward::LoadError::Engine { .. }));
    }
    if let Some(c) = e.downcast_ref::<CheckpointError>() {
        // A checkpoint the user pointed at that is damaged, absent or for another model is
        // theirs to fix; failing to read or write a file is not.
        return Some(!matches!(c, CheckpointError::Io { .. }));
    }
    if let Some(engine) = e.downcast_ref::<anneal_engine::Error>() {
        // A plugin's refusal of its input is the user's to fix; any other engine error is not.
        return Some(matches!(engine, anneal_engine::Error::PluginRefused { .. }));
    }
    if e.is::<std::io::Error>() {
        return Some(false);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once_on_one_line() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = anyhow::Error::new(CheckpointError::Io {
            path: "runs/a/step-1".into(),
            source: io,
        })
        .context("checkpoint");
        assert_eq!(one_line(&e), "checkpoint: runs/a/step-1: No such file");
        let e = anyhow::Error::new(UserError("two\nlines".into())).context("outer");
        assert_eq!(one_line(&e), "outer: two lines");
    }

    #[test]
    fn user_errors_exit_2_and_failures_1() {
        let user = anyhow::Error::new(UserError("bad".into())).context("while reading");
        assert_eq!(exit_code(&user), 2);
        let io = anyhow::Error::new(std::io::Error::other("disk full")).context("saving");
        assert_eq!(exit_code(&io), 1);
        assert_eq!(exit_code(&anyhow::anyhow!("something unexpected")), 1);
        let mismatch = anyhow::Error::new(CheckpointError::Mismatch("other model".into()));
        assert_eq!(exit_code(&mismatch), 2);
    }
}
