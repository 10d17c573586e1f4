//! `anneal`: the command-line edge of the host. Parses arguments, calls into the library crates,
//! and turns their errors into one clear line (exit code 2 for user errors).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod reward_cmd;

/// Train, post-train and serve language models.
#[derive(Parser)]
#[command(name = "anneal", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print what this build of the host can use: backends, threads, SIMD features.
    Info,
    /// Work with reward modules (WebAssembly): `anneal reward test MODULE`.
    #[command(subcommand)]
    Reward(reward_cmd::RewardCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
        Command::Reward(command) => reward_cmd::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn info() -> anyhow::Result<()> {
    println!("anneal {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}
