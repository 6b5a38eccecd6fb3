//! `limiter lab`: the demo. Builds a two-namespace lab, attaches the limiter
//! to the receiving side, floods it from a few sources and shows, live, what
//! arrives per source next to the configured limit. Removes the lab after.

use std::{
    collections::HashMap,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use limiter::{
    kernel::require_root,
    lab::{self, FloodSource, Lab},
    render::text,
    rules::{EXAMPLE, RuleSet, describe::describe, matching::matching_rule},
    session::Session,
    units::count,
    wire::Mode,
};

/// Demo sources: (address, packets per second, UDP payload bytes).
const SOURCES: [(&str, u64, usize); 6] = [
    ("198.18.0.1", 3000, 64),
    ("198.18.0.2", 2000, 64),
    ("2001:db8:1::1", 2000, 500),
    ("2001:db8:1::2", 2000, 500),
    ("198.19.128.1", 600, 64),
    ("198.18.255.1", 1500, 64),
];

const LAB_NAME: &str = "limiter-lab";
const PIN_DIR: &str = "/sys/fs/bpf/limiter-lab";

pub fn run(config: Option<&Path>, duration: Duration, mode: Mode) -> Result<()> {
    require_root()?;
    let rules = match config {
        Some(path) => RuleSet::load(path)?,
        None => RuleSet::parse(EXAMPLE, &PathBuf::from("examples/rules.yaml"))?,
    };
    println!("lab: creating namespaces {LAB_NAME}-tx and {LAB_NAME}-rx joined by a veth pair");
    let lab = Lab::create(LAB_NAME)?;
    let session = lab.rx.enter(|| {
        Session::start(
            &rules,
            &[lab::RX_IFACE.to_owned()],
            mode,
            Path::new(PIN_DIR),
        )
    })??;
    println!(
        "lab: limiter attached to {} ({} mode) in {LAB_NAME}-rx with these rules:\n",
        lab::RX_IFACE,
        format!("{:?}", session.attachments[0].mode).to_lowercase()
    );
    print!("{}", text::rules_table(&rules));
    println!(
        "\nlab: to watch why packets are dropped, in another shell: \
         sudo nsenter --net=/run/netns/{LAB_NAME}-rx limiter trace --pin-dir {PIN_DIR} --source 198.18.0.1 --sample 100"
    );

    let target = lab.target(0);
    let sources: Vec<FloodSource> = SOURCES
        .iter()
        .map(|&(addr, pps, payload)| {
            let addr: IpAddr = addr.parse().expect("literal address");
            FloodSource {
                addr,
                frame: lab::udp_frame(&target, addr, payload),
                pps,
            }
        })
        .collect();
    println!(
        "\nlab: flooding for {} from {} sources\n",
        humantime::format_duration(duration),
        sources.len()
    );
    let socket = lab.sender(0)?;
    let sent = Arc::new(Mutex::new(vec![0u64; sources.len()]));
    let flood = {
        let (sources, sent) = (sources.clone(), Arc::clone(&sent));
        thread::spawn(move || {
            lab::flood(&socket, &sources, duration, |now| {
                sent.lock().expect("lock").clone_from_slice(now)
            })
        })
    };
    let start = Instant::now();
    let mut previous = (vec![0u64; sources.len()], HashMap::new(), start);
    while !flood.is_finished() {
        thread::sleep(Duration::from_secs(2).min(duration));
        let now_sent = sent.lock().expect("lock").clone();
        let received = lab.received()?;
        let elapsed = previous.2.elapsed().as_secs_f64();
        let rows = rows(&rules, &sources, |i, addr| {
            let arrived = received.get(addr).copied().unwrap_or(0);
            let before = previous.1.get(addr).copied().unwrap_or(0);
            let sent_rate = (now_sent[i] - previous.0[i]) as f64 / elapsed;
            let arrived_rate = arrived.saturating_sub(before) as f64 / elapsed;
            (sent_rate, arrived_rate)
        });
        println!("t = {:>4.1} s", start.elapsed().as_secs_f64());
        print!(
            "{}",
            text::table(
                &[
                    "SOURCE",
                    "RULE",
                    "LIMIT",
                    "SENT pkt/s",
                    "ARRIVED pkt/s",
                    "DROPPED pkt/s"
                ],
                &rows
            )
        );
        println!();
        previous = (now_sent, received, Instant::now());
    }
    let report = flood
        .join()
        .map_err(|_| anyhow::anyhow!("flood thread panicked"))??;
    thread::sleep(Duration::from_millis(100));
    let received = lab.received()?;
    let mut total_rows = Vec::new();
    for (i, source) in sources.iter().enumerate() {
        let arrived = received.get(&source.addr).copied().unwrap_or(0);
        total_rows.push(vec![
            source.addr.to_string(),
            count(report.sent[i]),
            count(arrived),
            count(report.sent[i] - arrived.min(report.sent[i])),
        ]);
    }
    println!(
        "totals over {:.2} s, counted at the receiver (nftables), not by the limiter:",
        report.elapsed.as_secs_f64()
    );
    print!(
        "{}",
        text::table(&["SOURCE", "SENT", "ARRIVED", "DROPPED"], &total_rows)
    );
    println!("\nthe limiter's own counters:");
    print!("{}", text::stats_table(&session.snapshot()?));
    drop(session);
    drop(lab);
    println!("\nlab: detached and removed the namespaces");
    Ok(())
}

/// One row per source: the rule it falls under, its limit, and its rates.
fn rows(
    rules: &RuleSet,
    sources: &[FloodSource],
    rates: impl Fn(usize, &IpAddr) -> (f64, f64),
) -> Vec<Vec<String>> {
    sources
        .iter()
        .enumerate()
        .map(|(i, source)| {
            let rule = matching_rule(rules, source.addr, 17, Some(9)).map(|i| &rules.rules[i]);
            let limit = rule.map_or_else(
                || format!("default: {:?}", rules.default).to_lowercase(),
                |r| describe(r).limit,
            );
            let (sent, arrived) = rates(i, &source.addr);
            vec![
                source.addr.to_string(),
                rule.map_or("-".into(), |r| r.name.clone()),
                limit,
                count(sent.round() as u64),
                count(arrived.round() as u64),
                count((sent - arrived).max(0.0).round() as u64),
            ]
        })
        .collect()
}
