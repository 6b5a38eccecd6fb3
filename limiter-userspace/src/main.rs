//! `limiter`: an XDP per-source rate limiter.

mod commands;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use limiter::{datapath::Mode, pins::DEFAULT_PIN_DIR};

#[derive(Parser)]
#[command(
    version,
    about = "Per-source rate limits in XDP, before the kernel allocates anything"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Attach to interfaces and enforce a rule file until SIGINT/SIGTERM.
    Run {
        /// Interface to attach to (repeat for several; they share one set of buckets).
        #[arg(long = "iface", required = true)]
        ifaces: Vec<String>,
        /// The rule file (YAML).
        #[arg(long)]
        config: PathBuf,
        /// XDP attach mode: auto tries native, then skb.
        #[arg(long, value_enum, default_value_t = Mode::Auto)]
        mode: Mode,
        /// Where the maps are pinned (below a bpffs mount).
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// How often to print a summary line.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
    /// Print the counters of the running limiter.
    Stats {
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Validate a rule file without touching the kernel.
    Check {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Demo: build a two-namespace lab, flood it from a few sources and show
    /// what the limiter passes and drops per source; removes the lab after.
    Lab {
        /// Rule file to enforce (default: the built-in example).
        #[arg(long)]
        config: Option<PathBuf>,
        /// How long to flood.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long, value_enum, default_value_t = Mode::Native)]
        mode: Mode,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LIMITER_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .without_time()
        .with_target(false)
        .init();
    let result = match Cli::parse().command {
        Command::Run {
            ifaces,
            config,
            mode,
            pin_dir,
            interval,
        } => commands::run::run(&ifaces, &config, mode, &pin_dir, interval),
        Command::Stats { pin_dir, json } => commands::stats(&pin_dir, json),
        Command::Check { config, json } => commands::check(&config, json),
        Command::Lab {
            config,
            duration,
            mode,
        } => commands::lab::run(config.as_deref(), duration, mode),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
