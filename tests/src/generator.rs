//! The in-kernel flood (benchmarks, and the test of a forged flood): BPF_PROG_TEST_RUN in live-frames mode runs the
//! `flood` program on one crafted frame, which rewrites the source and sends
//! it out of the sending veth (XDP_TX). What the receiver processed is read
//! from the receiving veth's own rx counter (it counts every frame its XDP
//! hook saw), so every peer is measured the same way, independently of its
//! own counters.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use crate::pin_to_cpu;
use anyhow::{Context, Result};
use aya::{
    Ebpf,
    maps::Array,
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp},
};
use limiter::{
    kernel::if_index,
    lab::{Lab, RX_IFACE, TX_IFACE, udp_frame},
};

/// Where the sources of a flood come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sources {
    /// Cycling through this many consecutive addresses of 198.0.0.0/8.
    Cycle(u32),
    /// Every frame from a random address of 198.0.0.0/8 (16 M sources):
    /// a flood of forged sources.
    Random,
}

impl Sources {
    pub fn describe(self) -> String {
        match self {
            Sources::Cycle(1) => "one source".to_owned(),
            Sources::Cycle(n) => format!("{n} sources in turn"),
            Sources::Random => "a random source of a /8 per frame".to_owned(),
        }
    }
}

pub fn object() -> Result<Vec<u8>> {
    let path = std::env::var_os("LIMITER_FLOOD_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../limiter-ebpf/target/bpfel-unknown-none/release/flood")
        });
    std::fs::read(&path).with_context(|| format!("{} (cargo xtask build makes it)", path.display()))
}

pub struct Generator {
    ebpf: Ebpf,
    frame: Vec<u8>,
}

/// One flood: frames generated, frames the receiver processed, and the
/// receiver's rate sampled over time (seconds since start, Mpps).
pub struct Run {
    pub generated: u64,
    pub processed: u64,
    pub seconds: f64,
    pub timeline: Vec<(f64, f64)>,
}

impl Run {
    pub fn mpps(&self) -> f64 {
        self.processed as f64 / self.seconds / 1e6
    }
}

impl Generator {
    pub fn new(lab: &Lab) -> Result<Self> {
        let mut ebpf = Ebpf::load(&object()?)?;
        let flood: &mut Xdp = ebpf.program_mut("flood").context("flood")?.try_into()?;
        flood.load()?;
        let frame = udp_frame(&lab.target(0), "198.0.0.0".parse()?, 18);
        Ok(Self { ebpf, frame })
    }

    pub fn frame(&self) -> &[u8] {
        &self.frame
    }

    fn set_sources(&mut self, sources: Sources) -> Result<()> {
        let mut config = Array::<_, u32>::try_from(
            self.ebpf
                .map_mut("FLOOD_SOURCES")
                .context("FLOOD_SOURCES")?,
        )?;
        match sources {
            Sources::Cycle(n) => {
                config.set(0, n, 0)?;
                config.set(1, 0, 0)?;
            }
            Sources::Random => config.set(1, 1, 0)?,
        }
        Ok(())
    }

    /// Sends exactly `frames` frames (rounded up to a batch), unmeasured:
    /// to create the keys of a scale run before it is timed.
    pub fn send(&mut self, lab: &Lab, sources: Sources, frames: u64) -> Result<()> {
        self.set_sources(sources)?;
        let flood: &Xdp = self.ebpf.program("flood").context("flood")?.try_into()?;
        let frame = &self.frame;
        lab.tx.enter(|| -> Result<()> {
            let ctx = xdp_md(frame)?;
            let mut sent = 0;
            while sent < frames {
                let repeat = (frames - sent).min(1 << 20) as u32;
                run_batch(flood, frame, &ctx, repeat)?;
                sent += u64::from(repeat);
            }
            Ok(())
        })?
    }

    /// Floods for `duration` from one sender per CPU, sampling the
    /// receiver's rx counter. Each sender is pinned to its CPU and its frames
    /// land in that CPU's receive queue (a lab built with
    /// [`Lab::with_queues`]), where the receiver's XDP program runs in the
    /// same CPU's softirq: every CPU sends and receives, as a multi-queue NIC
    /// spreads a flood, and the generator's own cost is the same for every
    /// receiver measured.
    pub fn flood(&mut self, lab: &Lab, sources: Sources, duration: Duration) -> Result<Run> {
        self.set_sources(sources)?;
        let flood: &Xdp = self.ebpf.program("flood").context("flood")?.try_into()?;
        let frame = &self.frame;
        let cpus = online_cpus();
        let running = AtomicUsize::new(cpus);
        let before = rx_packets(lab)?;
        let start = Instant::now();
        let (generated, timeline) = thread::scope(|scope| -> Result<_> {
            let senders: Vec<_> = (0..cpus)
                .map(|cpu| {
                    let running = &running;
                    scope.spawn(move || {
                        let generated = lab.tx.enter(|| -> Result<u64> {
                            pin_to_cpu(cpu)?;
                            let ctx = xdp_md(frame)?;
                            let mut generated = 0u64;
                            while start.elapsed() < duration {
                                let repeat = 200_000;
                                run_batch(flood, frame, &ctx, repeat)?;
                                generated += u64::from(repeat);
                            }
                            Ok(generated)
                        });
                        running.fetch_sub(1, Ordering::Relaxed);
                        generated
                    })
                })
                .collect();
            let mut timeline = Vec::new();
            let (mut last_t, mut last_n) = (0.0, before);
            while running.load(Ordering::Relaxed) > 0 {
                thread::sleep(Duration::from_millis(200));
                let n = rx_packets(lab)?;
                let t = start.elapsed().as_secs_f64();
                timeline.push((t, (n - last_n) as f64 / (t - last_t) / 1e6));
                (last_t, last_n) = (t, n);
            }
            let mut generated = 0;
            for sender in senders {
                generated += sender
                    .join()
                    .map_err(|_| anyhow::anyhow!("flood thread panicked"))???;
            }
            Ok((generated, timeline))
        })?;
        // The last batch ends a little after `duration`.
        let seconds = start.elapsed().as_secs_f64();
        // Frames still queued at the receiver land within a few ms.
        thread::sleep(Duration::from_millis(100));
        Ok(Run {
            generated,
            processed: rx_packets(lab)? - before,
            seconds,
            timeline,
        })
    }
}

fn online_cpus() -> usize {
    thread::available_parallelism().map_or(1, usize::from)
}

/// struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
fn xdp_md(frame: &[u8]) -> Result<[u8; 24]> {
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&if_index(TX_IFACE)?.to_ne_bytes());
    Ok(ctx)
}

fn run_batch(flood: &Xdp, frame: &[u8], ctx: &[u8], repeat: u32) -> Result<()> {
    flood.test_run(TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(ctx),
        repeat,
        attrs: TestRunAttrs::new().xdp_live_frames(64),
        ..TestRunOptions::default()
    })?;
    Ok(())
}

/// Frames the receiving veth's XDP hook has seen (its rx counter).
pub fn rx_packets(lab: &Lab) -> Result<u64> {
    let json = lab
        .rx
        .exec("ip", &["-s", "-j", "link", "show", "dev", RX_IFACE])?;
    let value: serde_json::Value = serde_json::from_str(&json)?;
    value[0]["stats64"]["rx"]["packets"]
        .as_u64()
        .context("no rx packet counter in `ip -s -j link`")
}
