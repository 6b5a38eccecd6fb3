//! The command line.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{Guest, GuestCommand, GuestEnd, Kernel, MATRIX, Run, kernel, run};

#[derive(clap::Args)]
pub struct Options {
    /// A kernel of the matrix (5.10, 6.1, 6.12), or `all`: one after the other.
    #[arg(long, default_value = "6.1")]
    kernel: String,
    /// A host file or directory to copy in, at the same path (repeatable).
    /// The command's program comes along when it is a host file or on the
    /// host's PATH.
    #[arg(long = "file", value_name = "PATH")]
    files: Vec<PathBuf>,
    /// NAME=VALUE in the command's environment (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// A module to load besides the usual (veth, nf_tables), with its
    /// dependencies (repeatable).
    #[arg(long = "module", value_name = "NAME")]
    modules: Vec<String>,
    /// Seconds the command may run.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// The command's working directory in the guest.
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Keep the work directory (initramfs, console log, qemu command line).
    #[arg(long)]
    keep: bool,
    /// Seconds the whole guest may run (default: the command's timeout
    /// and two minutes to boot).
    #[arg(long, value_name = "SECS")]
    guest_timeout: Option<u64>,
    /// The command and its arguments; `cat /proc/version` by default.
    #[arg(last = true)]
    command: Vec<String>,
}

/// `cargo xtask vm`: the command in each kernel asked for, its output
/// shown as it comes; fails unless it exits 0 in every one.
pub fn cli(options: &Options) -> Result<()> {
    let kernels: Vec<&Kernel> = if options.kernel == "all" {
        MATRIX.iter().collect()
    } else {
        vec![kernel(&options.kernel)?]
    };
    let guest = cli_guest(options)?;
    let mut failed = Vec::new();
    let mut summary = Vec::new();
    for kernel in kernels {
        crate::step(&format!(
            "guest: Debian {} ({}), kernel {}",
            kernel.debian, kernel.suite, kernel.name
        ));
        let run = run(kernel, &guest)?;
        report(&run);
        let boot = run.boot.map_or("no boot".to_owned(), |b| {
            format!("booted in {:.1} s", b.as_secs_f64())
        });
        let (_, outcome) = &run.outcomes[0];
        summary.push(format!(
            "{:>5}  {}  {boot}, {:?} after {:.1} s",
            kernel.name,
            run.release.as_deref().unwrap_or("?"),
            outcome.status,
            outcome.elapsed.as_secs_f64()
        ));
        if !run.success() {
            failed.push(kernel.name);
        }
    }
    println!("\nxtask: vm summary\n{}", summary.join("\n"));
    if !failed.is_empty() {
        bail!("failed in kernel {}", failed.join(", "));
    }
    Ok(())
}

fn cli_guest(options: &Options) -> Result<Guest> {
    let argv = if options.command.is_empty() {
        vec!["cat".to_owned(), "/proc/version".to_owned()]
    } else {
        options.command.clone()
    };
    let mut files = options.files.clone();
    // The program itself: a host file, or what the host's PATH finds
    // (else the guest's PATH finds it, or busybox's applet of that name).
    let program = Path::new(&argv[0]);
    if program.is_absolute() {
        files.push(program.to_owned());
    } else if !options.command.is_empty()
        && let Some(found) = crate::setup::which(&argv[0])
    {
        files.push(found);
    }
    let env = options
        .env
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("--env {pair}: not NAME=VALUE"))
        })
        .collect::<Result<_>>()?;
    let mut modules = Guest::default().modules;
    modules.extend(options.modules.iter().cloned());
    let mut command = GuestCommand::new(argv.join(" "), argv, Duration::from_secs(options.timeout));
    command.cwd.clone_from(&options.cwd);
    Ok(Guest {
        files,
        env,
        modules,
        commands: vec![command],
        echo: true,
        keep: options.keep,
        overall_timeout: options.guest_timeout.map(Duration::from_secs),
        ..Guest::default()
    })
}

/// What the console showed does not need repeating; how the guest ended does.
fn report(run: &Run) {
    for warning in &run.warnings {
        println!("xtask: guest warning: {warning}");
    }
    match &run.end {
        GuestEnd::PoweredOff => {}
        GuestEnd::TimedOut(limit) => {
            println!(
                "xtask: the guest ran past {limit:?} and was killed; its console's last lines:"
            );
            print_tail(&run.console_tail);
        }
        GuestEnd::Died(why) => {
            println!("xtask: the guest died: {why}; its console's last lines:");
            print_tail(&run.console_tail);
        }
    }
    if let Some(dir) = &run.workdir {
        println!("xtask: kept {}", dir.display());
    }
}

fn print_tail(lines: &[String]) {
    for line in &lines[lines.len().saturating_sub(30)..] {
        println!("    {line}");
    }
}
