//! How long `limiter daemon` takes from its start to enforcing: spawned
//! in the lab's receiving namespace with the example rules, its log
//! polled every 5 ms for the line saying it attached (a fresh start, no
//! pins) or adopted the link it pinned before (a restart). Mostly the
//! kernel's verification of the programs. The binary is the release build
//! `cargo xtask bench` makes (`LIMITER_BIN`).

use std::{
    fs,
    path::Path,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{TempDir, limiter_command};

const PIN_DIR: &str = "/sys/fs/bpf/limiter-bench-start";

/// The start times in seconds: fresh, then restarts over the pins.
pub struct Starts {
    pub fresh: Vec<f64>,
    pub restart: Vec<f64>,
}

pub fn measure(lab: &Lab, runs: usize) -> Result<Starts> {
    let dir = TempDir::new("bench-start");
    let rules =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules.yaml"))?;
    dir.write("rules.yaml", &rules);
    let run = dir.0.join("run");
    let config = dir.write(
        "daemon.yaml",
        &format!(
            "rules: rules.yaml\ninterfaces: [{{ name: {RX_IFACE}, mode: native }}]\npin_dir: {PIN_DIR}\nsocket: {}\nmetrics: off\n",
            run.join("control.sock").display()
        ),
    );
    let socket = run.join("control.sock");
    let once = |fresh: bool| -> Result<f64> {
        if fresh {
            detach(&socket);
        }
        let log = dir.0.join("daemon.log");
        let file = fs::File::create(&log)?;
        let start = Instant::now();
        let mut child = limiter_command(
            Some(lab.rx.name()),
            &["daemon", "--config", &config.to_string_lossy()],
        )
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .context("spawning limiter daemon")?;
        let word = if fresh {
            "attached"
        } else {
            "adopted the pinned link"
        };
        let seconds = loop {
            if fs::read_to_string(&log)?.contains(word) {
                break start.elapsed().as_secs_f64();
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "limiter daemon exited ({status}):\n{}",
                    fs::read_to_string(&log)?
                );
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                bail!(
                    "limiter daemon did not attach in 30 s:\n{}",
                    fs::read_to_string(&log)?
                );
            }
            thread::sleep(Duration::from_millis(5));
        };
        // Killed, as a crash would: the link stays pinned for the restart.
        child.kill()?;
        child.wait()?;
        Ok(seconds)
    };
    let fresh = (0..runs).map(|_| once(true)).collect::<Result<Vec<_>>>()?;
    once(true)?;
    let restart = (0..runs).map(|_| once(false)).collect::<Result<Vec<_>>>()?;
    detach(&socket);
    Ok(Starts { fresh, restart })
}

/// Detaches what a run left attached and removes its pins.
fn detach(socket: &Path) {
    let socket = socket.to_string_lossy();
    let _ = limiter_command(None, &["detach", "--pin-dir", PIN_DIR, "--socket", &socket])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = fs::remove_dir_all(PIN_DIR);
}
