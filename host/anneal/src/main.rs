//! `anneal`: the command-line edge of the host. Parses arguments, calls into the library crates,
//! and turns their errors into one clear line (exit code 2 for user errors).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
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
