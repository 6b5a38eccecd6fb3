//! qemu, and what its console says.

use std::{
    fs::File,
    io::{BufRead, BufReader, BufWriter, Read, Write},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{Guest, GuestEnd, Run, console::Console};

pub(super) fn qemu_command(vmlinuz: &Path, initramfs: &Path, memory_mib: u32) -> Command {
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(["-accel", "tcg", "-cpu", "max", "-smp", "2"])
        .args(["-m", &memory_mib.to_string()])
        // No default devices (network card, VGA): the guests need none.
        .args(["-nodefaults", "-no-user-config", "-nographic"])
        .args(["-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initramfs)
        // loglevel=4: the kernel's warnings and errors on the console,
        // not its boot chatter. trust_cpu: 5.10 would otherwise wait for
        // entropy (tokio, rustls) on an idle guest.
        .args([
            "-append",
            "console=ttyS0 panic=-1 loglevel=4 random.trust_cpu=on rdinit=/init",
        ]);
    command
}

/// Starts qemu and follows its console until the guest is done, dies, or
/// runs past `limit`.
pub(super) fn watch(
    mut qemu: Command,
    guest: &Guest,
    nonce: &str,
    limit: Duration,
    log: &Path,
) -> Result<Run> {
    let started = Instant::now();
    let mut child = qemu
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let lines = console_lines(&mut child)?;
    let stderr = child.stderr.take().map(|mut stderr| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        })
    });
    let mut log =
        BufWriter::new(File::create(log).with_context(|| format!("creating {}", log.display()))?);
    let mut console = Console::new(guest, nonce, started);
    let deadline = started + limit;
    let timed_out = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                writeln!(log, "{line}")?;
                console.line(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => break true,
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
        }
    };
    log.flush()?;
    if timed_out {
        // Ours to end: qemu, started above.
        let _ = child.kill();
    }
    let status = child.wait().context("waiting for qemu")?;
    let stderr = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    let end = if timed_out {
        GuestEnd::TimedOut(limit)
    } else if console.done {
        GuestEnd::PoweredOff
    } else {
        GuestEnd::Died(format!("qemu exited ({status}) {}", stderr.trim()))
    };
    Ok(console.finish(end))
}

/// qemu's stdout (the serial console), line by line, from a thread.
fn console_lines(child: &mut Child) -> Result<mpsc::Receiver<String>> {
    let stdout = child.stdout.take().context("qemu's stdout")?;
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = Vec::new();
        while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            let text = without_escapes(&String::from_utf8_lossy(&line));
            line.clear();
            if send.send(text).is_err() {
                break;
            }
        }
    });
    Ok(receive)
}

/// A console line without its end, and without the terminal escapes the
/// firmware prints (clear screen, line wrap), which garble a terminal.
fn without_escapes(line: &str) -> String {
    let mut text = String::with_capacity(line.len());
    let mut chars = line.trim_end_matches(['\n', '\r']).chars();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            text.push(c);
            continue;
        }
        // ESC [ parameters final-letter, or ESC and one character.
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_lines_lose_terminal_escapes() {
        let line = "\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS (version 1.16.2)\r\n";
        assert_eq!(without_escapes(line), "SeaBIOS (version 1.16.2)");
    }
}
