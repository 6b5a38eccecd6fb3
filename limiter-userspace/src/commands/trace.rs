//! `limiter trace`: the kernel's decisions as they happen, like tcpdump
//! for the limiter. Through the daemon when one answers on the control
//! socket, else straight from the pins of whatever limiter runs
//! (`limiter run` has no socket).

use std::{
    io::Write,
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::Result;
use limiter::{
    control::Client,
    kernel::{require_root, trace::KernelTracer},
    trace::{TraceFilter, TraceLine, header},
};

/// Where to trace from, and when to stop.
pub struct Trace<'a> {
    pub pin_dir: &'a Path,
    pub socket: &'a Path,
    pub filter: TraceFilter,
    /// Stop after this many lines.
    pub count: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    pub json: bool,
}

pub fn run(trace: Trace<'_>) -> Result<()> {
    require_root()?;
    let mut out = Printer::new(trace.json, trace.count);
    let daemon = Client::new(trace.socket);
    if daemon.daemon_running() {
        let started = || {
            eprintln!(
                "limiter trace: tracing through the daemon at {} (Ctrl-C stops)",
                trace.socket.display()
            );
        };
        return daemon.trace(trace.filter, trace.duration, started, |line| {
            out.print(&line)
        });
    }
    let mut tracer = KernelTracer::start(trace.pin_dir, &trace.filter)?;
    eprintln!(
        "limiter trace: tracing the limiter pinned at {} (Ctrl-C stops)",
        trace.pin_dir.display()
    );
    // Stopped by a signal, the trace must still be turned off: the
    // handler only raises a flag the loop reads.
    stop_on_signals()?;
    let started = Instant::now();
    'trace: while !STOP.load(Ordering::Relaxed)
        && trace.duration.is_none_or(|d| started.elapsed() < d)
    {
        tracer.wait(Duration::from_millis(100))?;
        while let Some(line) = tracer.next_line() {
            if !out.print(&line)? {
                break 'trace;
            }
        }
    }
    let [traced, lost] = tracer.counts()?;
    drop(tracer);
    if lost > 0 {
        eprintln!(
            "limiter trace: {lost} of {} decisions lost (the ring was full: sample with --sample N)",
            traced + lost
        );
    }
    Ok(())
}

/// Prints lines, text with a header or JSON, and counts them.
struct Printer {
    json: bool,
    left: Option<u64>,
    header_done: bool,
}

impl Printer {
    fn new(json: bool, count: Option<u64>) -> Self {
        Self {
            json,
            left: count,
            header_done: false,
        }
    }

    /// Prints a line; whether to go on.
    fn print(&mut self, line: &TraceLine) -> Result<bool> {
        if self.left == Some(0) {
            return Ok(false);
        }
        let mut stdout = std::io::stdout().lock();
        if self.json {
            writeln!(stdout, "{}", serde_json::to_string(line)?)?;
        } else {
            if !self.header_done {
                writeln!(stdout, "{}", header())?;
                self.header_done = true;
            }
            writeln!(stdout, "{}", line.text())?;
        }
        stdout.flush()?;
        if let Some(left) = &mut self.left {
            *left -= 1;
        }
        Ok(self.left != Some(0))
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn raise_stop(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn stop_on_signals() -> Result<()> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(raise_stop),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGPIPE] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(signal, &action) }?;
    }
    Ok(())
}
