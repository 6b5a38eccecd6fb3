//! The kernel datapath against its peers, in one run on the same traffic:
//! the limiter's XDP program, iptables `hashlimit` and an nftables per-source
//! `limit`, each holding 256 flooding sources to 1,000 pps. The flood is
//! generated in the kernel (BPF_PROG_TEST_RUN in live-frames mode, XDP_TX
//! out of the sending veth) and the receiving side's throughput is what it
//! processed per second: the limiter's own packet counter, or a netfilter
//! counter rule in front of the limit. Needs root; `cargo xtask bench`.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    maps::Array,
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp, xdp::XdpMode},
};
use limiter::{
    kernel::{Mode, if_index},
    lab::{Lab, Netns, RX_IFACE, TX_IFACE, udp_frame},
    rules::RuleSet,
    session::Session,
};

const SOURCES: u32 = 256;
const DURATION: Duration = Duration::from_secs(4);
const RULES: &str = "rules:\n  - { name: bench, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 1000, unit: second, burst: 100 } }\n";

fn flood_object() -> Result<Vec<u8>> {
    let path = std::env::var_os("LIMITER_FLOOD_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../limiter-ebpf/target/bpfel-unknown-none/release/flood")
        });
    std::fs::read(&path).with_context(|| format!("{} (cargo xtask build makes it)", path.display()))
}

/// Floods from the sending namespace for `DURATION`; returns frames generated.
fn generate(tx: &Netns, flood: &Xdp, frame: &[u8]) -> Result<u64> {
    tx.enter(|| -> Result<u64> {
        let ifindex = if_index(TX_IFACE)?;
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let start = Instant::now();
        let mut generated = 0u64;
        while start.elapsed() < DURATION {
            let repeat = 500_000;
            flood.test_run(TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat,
                attrs: TestRunAttrs::new().xdp_live_frames(64),
                ..TestRunOptions::default()
            })?;
            generated += u64::from(repeat);
        }
        Ok(generated)
    })?
}

/// A netfilter counter's packets, from `iptables -nvxL` or `nft -j`.
fn iptables_counter(rx: &Netns) -> Result<u64> {
    let out = rx.exec("iptables", &["-t", "raw", "-nvxL", "PREROUTING"])?;
    // The first rule is the bare counter.
    let line = out.lines().nth(2).context("no counter rule")?;
    line.split_whitespace()
        .next()
        .context("no packet count")?
        .parse()
        .context("packet count")
}

fn nft_counter(rx: &Netns) -> Result<u64> {
    let json = rx.exec(
        "nft",
        &["-j", "list", "chain", "inet", "bench", "prerouting"],
    )?;
    let value: serde_json::Value = serde_json::from_str(&json)?;
    value["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item["rule"]["expr"].as_array())
        .flatten()
        .find_map(|expr| expr["counter"]["packets"].as_u64())
        .context("no nft counter")
}

/// Floods and reads how far the receiver's `counter` moved.
fn measure(
    name: &'static str,
    tx: &Netns,
    flood: &Xdp,
    frame: &[u8],
    counter: impl Fn() -> Result<u64>,
) -> Result<Result_> {
    let before = counter()?;
    let start = Instant::now();
    let generated = generate(tx, flood, frame)?;
    let seconds = start.elapsed().as_secs_f64();
    // Let the last frames land.
    std::thread::sleep(Duration::from_millis(200));
    Ok(Result_ {
        name,
        generated,
        processed: counter()? - before,
        seconds,
    })
}

struct Result_ {
    name: &'static str,
    generated: u64,
    processed: u64,
    seconds: f64,
}

fn main() -> Result<()> {
    // criterion-style filter arguments are accepted and ignored.
    limiter::kernel::require_root()?;
    limiter::kernel::pins::ensure_bpffs()?;
    let lab = Lab::create("lb-bench")?;
    let object = flood_object()?;
    let mut generator = Ebpf::load(&object)?;
    Array::<_, u32>::try_from(
        generator
            .map_mut("FLOOD_SOURCES")
            .context("FLOOD_SOURCES")?,
    )?
    .set(0, SOURCES, 0)?;
    let flood: &mut Xdp = generator
        .program_mut("flood")
        .context("flood")?
        .try_into()?;
    flood.load()?;
    let frame = udp_frame(&lab.target(0), "198.18.0.0".parse()?, 18);
    let mut results = Vec::new();

    // 0. Baseline: a receiver that drops everything at once. Generator and
    // receiver share the CPU, so the others' cost per packet is measured
    // above this.
    {
        let mut dropper = Ebpf::load(&object)?;
        let drop_all: &mut Xdp = dropper
            .program_mut("drop_all")
            .context("drop_all")?
            .try_into()?;
        drop_all.load()?;
        lab.rx
            .enter(|| drop_all.attach(RX_IFACE, XdpMode::Driver))??;
        let start = Instant::now();
        let generated = generate(&lab.tx, flood, &frame)?;
        let seconds = start.elapsed().as_secs_f64();
        results.push(Result_ {
            name: "baseline (XDP_DROP everything)",
            generated,
            processed: generated,
            seconds,
        });
        // Dropping the Ebpf detaches it.
    }

    // 1. The limiter, natively on the receiving veth.
    {
        let rules = RuleSet::parse(RULES, Path::new("bench"))?;
        let limiter = lab.rx.enter(|| {
            Session::start(
                &rules,
                &[RX_IFACE.to_owned()],
                Mode::Native,
                Path::new("/sys/fs/bpf/limiter-bench"),
            )
        })??;
        let counter = || Ok(limiter.snapshot()?.global.packets);
        results.push(measure(
            "limiter (XDP, native)",
            &lab.tx,
            flood,
            &frame,
            counter,
        )?);
    }

    // 2 and 3: netfilter behind a pass-all XDP program (a veth accepts
    // XDP_TX frames only when its peer runs an XDP program).
    let mut passer = Ebpf::load(&object)?;
    let pass: &mut Xdp = passer.program_mut("pass").context("pass")?.try_into()?;
    pass.load()?;
    lab.rx.enter(|| pass.attach(RX_IFACE, XdpMode::Driver))??;
    // The lab's own arrival counters drop at ingress, before netfilter.
    lab.rx
        .exec("nft", &["delete", "table", "netdev", "limiter_lab"])?;

    lab.rx.exec(
        "iptables",
        &["-t", "raw", "-A", "PREROUTING", "-i", RX_IFACE],
    )?;
    lab.rx.exec(
        "iptables",
        &[
            "-t",
            "raw",
            "-A",
            "PREROUTING",
            "-i",
            RX_IFACE,
            "-m",
            "hashlimit",
            "--hashlimit-above",
            "1000/sec",
            "--hashlimit-burst",
            "100",
            "--hashlimit-mode",
            "srcip",
            "--hashlimit-name",
            "bench",
            "-j",
            "DROP",
        ],
    )?;
    let counter = || iptables_counter(&lab.rx);
    results.push(measure(
        "iptables hashlimit (raw PREROUTING)",
        &lab.tx,
        flood,
        &frame,
        counter,
    )?);
    lab.rx
        .exec("iptables", &["-t", "raw", "-F", "PREROUTING"])?;

    let ruleset = format!(
        "table inet bench {{
  set flood {{ type ipv4_addr; size 65536; flags dynamic; timeout 10s; }}
  chain prerouting {{
    type filter hook prerouting priority raw; policy accept;
    iifname \"{RX_IFACE}\" counter
    iifname \"{RX_IFACE}\" update @flood {{ ip saddr limit rate over 1000/second burst 100 packets }} drop
  }}
}}"
    );
    let path = std::env::temp_dir().join("limiter-bench.nft");
    std::fs::write(&path, ruleset)?;
    lab.rx.exec("nft", &["-f", &path.to_string_lossy()])?;
    let counter = || nft_counter(&lab.rx);
    results.push(measure(
        "nftables per-source limit (prerouting)",
        &lab.tx,
        flood,
        &frame,
        counter,
    )?);

    let baseline_ns = results[0].seconds * 1e9 / results[0].processed as f64;
    let cost = |r: &Result_| r.seconds * 1e9 / r.processed.max(1) as f64 - baseline_ns;
    let reference = cost(&results[1]);
    println!(
        "\n{SOURCES} sources flooding, each limited to 1,000 pps; {} s per peer, frames of {} bytes\n",
        DURATION.as_secs(),
        frame.len()
    );
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let rate = r.processed as f64 / r.seconds;
            vec![
                r.name.to_owned(),
                format!("{:.2}", r.generated as f64 / r.seconds / 1e6),
                format!("{:.2}", rate / 1e6),
                format!("{:.0}", cost(r)),
                format!("{:.2}", cost(r) / reference),
            ]
        })
        .collect();
    print!(
        "{}",
        limiter::render::text::table(
            &[
                "PEER",
                "GENERATED Mpps",
                "PROCESSED Mpps",
                "ns/pkt ABOVE BASELINE",
                "COST vs LIMITER"
            ],
            &rows
        )
    );
    Ok(())
}
