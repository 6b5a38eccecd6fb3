//! What the guest's console says: its marker lines, and the commands'
//! output between them.

use std::{
    collections::VecDeque,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use super::{CommandOutcome, Guest, GuestEnd, OUTPUT_LINES, Run, Status};

/// Reads the console: markers, and the output between them.
pub(super) struct Console {
    nonce: String,
    echo: bool,
    started: Instant,
    names: Vec<String>,
    timeouts: Vec<Duration>,
    outcomes: Vec<Option<CommandOutcome>>,
    /// The command running: its index, start, output so far.
    current: Option<(usize, Instant, Tail)>,
    release: Option<String>,
    boot: Option<Duration>,
    warnings: Vec<String>,
    pub(super) done: bool,
    tail: Tail,
}

/// The last `OUTPUT_LINES` lines of something.
#[derive(Default)]
struct Tail {
    lines: VecDeque<String>,
    dropped: usize,
}

impl Tail {
    fn push(&mut self, line: String) {
        if self.lines.len() == OUTPUT_LINES {
            self.lines.pop_front();
            self.dropped += 1;
        }
        self.lines.push_back(line);
    }
}

impl Console {
    pub(super) fn new(guest: &Guest, nonce: &str, started: Instant) -> Self {
        Self {
            nonce: nonce.to_owned(),
            echo: guest.echo,
            started,
            names: guest.commands.iter().map(|c| c.name.clone()).collect(),
            timeouts: guest.commands.iter().map(|c| c.timeout).collect(),
            outcomes: vec![None; guest.commands.len()],
            current: None,
            release: None,
            boot: None,
            warnings: Vec::new(),
            done: false,
            tail: Tail::default(),
        }
    }

    pub(super) fn line(&mut self, line: String) {
        self.tail.push(line.clone());
        let Some(at) = line.find(&self.nonce) else {
            self.output(line);
            return;
        };
        // What came before the marker on its line: a program's last line
        // without its newline, or a kernel message.
        if !line[..at].trim().is_empty() {
            self.output(line[..at].to_owned());
        }
        let words: Vec<&str> = line[at + self.nonce.len()..].split_whitespace().collect();
        self.marker(&words);
    }

    /// A line of the running command's output (or of the kernel's).
    fn output(&mut self, line: String) {
        // Not before the guest is ready: the firmware's and the kernel's
        // boot, shown from the tail when the guest does not get that far.
        if self.echo && self.boot.is_some() {
            println!("{line}");
        }
        if let Some((_, _, output)) = &mut self.current {
            output.push(line);
        }
    }

    fn marker(&mut self, words: &[&str]) {
        let index = || words.get(1).and_then(|i| i.parse::<usize>().ok());
        match words.first().copied() {
            Some("ready") => {
                let boot = self.started.elapsed();
                self.release = words.get(1).map(|r| (*r).to_owned());
                self.boot = Some(boot);
                self.say(format!(
                    "guest: {} booted in {:.1} s",
                    self.release.as_deref().unwrap_or("?"),
                    boot.as_secs_f64()
                ));
            }
            Some("warn") => {
                let warning = words[1..].join(" ");
                self.say(format!("guest: warning: {warning}"));
                self.warnings.push(warning);
            }
            Some("start") => {
                if let Some(index) = index().filter(|&i| i < self.names.len()) {
                    self.say(format!("guest: running {}", self.names[index]));
                    self.current = Some((index, Instant::now(), Tail::default()));
                }
            }
            Some("end") => {
                let status = match (words.get(2).copied(), words.get(3)) {
                    (Some("exit"), Some(code)) => Status::Exited(code.parse().unwrap_or(-1)),
                    _ => Status::TimedOut,
                };
                if let Some((current, _, _)) = &self.current
                    && Some(*current) == index()
                {
                    self.end_current(status);
                }
            }
            Some("done") => self.done = true,
            _ => {}
        }
    }

    fn end_current(&mut self, status: Status) {
        let Some((index, started, output)) = self.current.take() else {
            return;
        };
        let elapsed = started.elapsed();
        let shown = match &status {
            Status::Exited(code) => format!("exit {code}"),
            Status::TimedOut => format!("timed out after {:?}", self.timeouts[index]),
            Status::Lost => "lost with the guest".to_owned(),
            Status::NotRun => "not run".to_owned(),
        };
        self.say(format!(
            "guest: {}: {shown} ({:.1} s)",
            self.names[index],
            elapsed.as_secs_f64()
        ));
        self.outcomes[index] = Some(CommandOutcome {
            status,
            elapsed,
            output: output.lines.into(),
            dropped_lines: output.dropped,
        });
    }

    fn say(&self, text: String) {
        if self.echo {
            println!("xtask: {text}");
        }
    }

    pub(super) fn finish(mut self, end: GuestEnd) -> Run {
        if self.current.is_some() {
            self.end_current(Status::Lost);
        }
        let outcomes = self
            .names
            .iter()
            .cloned()
            .zip(self.outcomes)
            .map(|(name, outcome)| {
                let outcome = outcome.unwrap_or(CommandOutcome {
                    status: Status::NotRun,
                    elapsed: Duration::ZERO,
                    output: Vec::new(),
                    dropped_lines: 0,
                });
                (name, outcome)
            })
            .collect();
        Run {
            release: self.release,
            boot: self.boot,
            outcomes,
            end,
            modules: Vec::new(),
            warnings: self.warnings,
            console_tail: self.tail.lines.into(),
            workdir: None,
        }
    }
}

/// Marks the guest's own lines: unlike anything a program prints.
pub(super) fn nonce() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("@@xtask-vm-{:x}{nanos:x}@@", std::process::id())
}
