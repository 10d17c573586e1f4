//! `anneal`: the command-line edge of the host. Parses arguments, calls into the library crates,
//! and turns their errors into one clear line (exit code 2 for user errors).

mod plugins_cmd;

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
    /// Print what this build of the host can use: backends, threads, SIMD level, memory.
    Info,
    /// Inspect model and optimizer plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// List the plugins in the search path: name, kind, API version, flavors, file.
    List,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
        Command::Plugins(PluginsCommand::List) => plugins_cmd::list(),
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
    use anneal_engine::{backend::backend_for, Device};
    println!("anneal {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu backend: {} threads, SIMD level {:?}",
        anneal_engine::num_threads(),
        anneal_engine::simd_level()
    );
    match backend_for(Device::Cuda(0)) {
        Ok(b) => println!("cuda backend: {}", b.name()),
        Err(e) => println!("cuda backend: unavailable ({e})"),
    }
    let m = anneal_engine::alloc::memory_stats();
    println!(
        "cpu allocator: {} B in use, {} B cached",
        m.current_bytes, m.cached_bytes
    );
    Ok(())
}
