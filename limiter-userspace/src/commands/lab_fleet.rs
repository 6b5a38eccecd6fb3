//! `limiter lab --fleet`: the fleet demo. Three hosts (namespaces), each a
//! `limiter daemon` behind its own sender, share one budget through a
//! Redis of the lab's own; floods them all, then one, then all with Redis
//! stopped, and shows each host's share and what arrives, counted at the
//! receivers. Removes everything after.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use limiter::{
    control::Client,
    kernel::{self, require_root},
    lab::{self, RX_IFACE, fleet::FleetLab},
    render::text,
    rules::RuleSet,
    units::count,
};

const NAME: &str = "limiter-fleet";
const HOSTS: usize = 3;
/// Packets per second from each of a host's two sources.
const SOURCE_PPS: u64 = 2000;
pub const EXAMPLE: &str = include_str!("../../../examples/fleet.yaml");

/// A daemon of the lab, killed and detached on drop.
struct HostDaemon {
    child: Child,
    socket: PathBuf,
    pin_dir: PathBuf,
}

impl Drop for HostDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = kernel::detach_all(&self.pin_dir);
    }
}

pub fn run(config: Option<&Path>, duration: Duration) -> Result<()> {
    require_root()?;
    let dir = tempdir()?;
    let rules_path = dir.join("rules.yaml");
    let text = match config {
        Some(path) => std::fs::read_to_string(path)?,
        None => EXAMPLE.to_owned(),
    };
    let rules = RuleSet::parse(&text, config.unwrap_or(Path::new("examples/fleet.yaml")))?;
    if !rules.rules.iter().any(|r| r.fleet.is_some()) {
        bail!("the rule file has no rule with `aggregate.scope: fleet`");
    }
    std::fs::write(&rules_path, &text)?;
    println!(
        "lab: {HOSTS} hosts ({NAME}0..{}), each with a sender, and a Redis in {NAME}-store",
        HOSTS - 1
    );
    let fleet = FleetLab::create(NAME, HOSTS, &dir)?;
    let ttl = Duration::from_secs(2);
    let daemons = (0..HOSTS)
        .map(|n| start_daemon(&fleet, n, &dir, &rules_path, ttl))
        .collect::<Result<Vec<_>>>()?;
    println!("lab: a limiter daemon on each host, with these rules:\n");
    print!("{}", text::rules_table(&rules));
    let budget = fleet_budget(&rules);

    let phase = duration / 3;
    let phases: [(&str, &[usize], bool); 3] = [
        ("every host flooded", &[0, 1, 2], false),
        ("the flood moves to host 1 alone", &[1], false),
        ("every host flooded, Redis stopped", &[0, 1, 2], true),
    ];
    for (what, hosts, stop_store) in phases {
        if stop_store {
            fleet.stop_store();
        }
        println!(
            "\nlab: {what} ({} pkt/s each), for {}",
            count(2 * SOURCE_PPS),
            humantime::format_duration(phase)
        );
        flood_and_show(&fleet, &daemons, hosts, phase, budget)?;
    }
    drop(daemons);
    drop(fleet);
    let _ = std::fs::remove_dir_all(&dir);
    println!("\nlab: stopped the daemons, detached and removed the namespaces");
    Ok(())
}

fn tempdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{NAME}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    Ok(dir)
}

/// (fleet rate, sum of reserves) of the first fleet rule, per its unit.
fn fleet_budget(rules: &RuleSet) -> (u64, u64) {
    rules
        .rules
        .iter()
        .find_map(|r| {
            let rate = r.aggregate?.packets?.rate;
            Some((rate, r.fleet?.reserve * HOSTS as u64))
        })
        .unwrap_or_default()
}

fn start_daemon(
    fleet: &FleetLab,
    n: usize,
    dir: &Path,
    rules: &Path,
    ttl: Duration,
) -> Result<HostDaemon> {
    let home = dir.join(format!("host{n}"));
    std::fs::create_dir_all(&home)?;
    let socket = home.join("run").join("control.sock");
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{NAME}{n}"));
    let _ = kernel::detach_all(&pin_dir);
    let config = home.join("daemon.yaml");
    std::fs::write(
        &config,
        format!(
            "rules: {}\ninterfaces: [{{ name: {RX_IFACE}, mode: native }}]\npin_dir: {}\nsocket: {}\nmetrics: off\n{}",
            rules.display(),
            pin_dir.display(),
            socket.display(),
            fleet.fleet_section(n, ttl)
        ),
    )?;
    let log = std::fs::File::create(home.join("daemon.log"))?;
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", fleet.hosts[n].rx.name()))
        .arg(std::env::current_exe()?)
        .args(["daemon", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting limiter daemon")?;
    let mut daemon = HostDaemon {
        child,
        socket,
        pin_dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Client::new(&daemon.socket).daemon_running() {
        if let Some(status) = daemon.child.try_wait()? {
            let log = std::fs::read_to_string(home.join("daemon.log")).unwrap_or_default();
            bail!("the daemon of host {n} exited ({status}):\n{log}");
        }
        if Instant::now() > deadline {
            bail!("the daemon of host {n} did not start within 30 s");
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(daemon)
}

/// Floods `hosts` for `duration`, printing each host's share and arrivals
/// every second.
fn flood_and_show(
    fleet: &FleetLab,
    daemons: &[HostDaemon],
    hosts: &[usize],
    duration: Duration,
    (rate, reserves): (u64, u64),
) -> Result<()> {
    thread::scope(|scope| {
        let floods: Vec<_> = hosts
            .iter()
            .map(|&n| {
                let lab = &fleet.hosts[n];
                let addrs: Vec<IpAddr> = (1..=2)
                    .map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, n as u8, i)))
                    .collect();
                let sources = lab.sources(0, &addrs, SOURCE_PPS, 64);
                scope.spawn(move || {
                    let socket = lab.sender(0)?;
                    lab::flood(&socket, &sources, duration, |_| {})
                })
            })
            .collect();
        let start = Instant::now();
        let mut before = arrivals(fleet)?;
        let mut at = Instant::now();
        // Whole seconds that end before the flood does.
        let windows = (duration.as_secs_f64() - 0.5).max(1.0) as u32;
        for _ in 0..windows {
            thread::sleep(Duration::from_secs(1));
            let now = arrivals(fleet)?;
            let secs = at.elapsed().as_secs_f64();
            at = Instant::now();
            let mut rows = Vec::new();
            let mut total = 0.0;
            for (n, daemon) in daemons.iter().enumerate() {
                let arrived = (now[n] - before[n]) as f64 / secs;
                total += arrived;
                let share = Client::new(&daemon.socket)
                    .rules_show()
                    .ok()
                    .and_then(|v| v.fleet.into_iter().next());
                rows.push(vec![
                    format!("{NAME}{n}"),
                    count(if hosts.contains(&n) {
                        2 * SOURCE_PPS
                    } else {
                        0
                    }),
                    count(arrived.round() as u64),
                    share.as_ref().map_or("-".into(), |s| count(s.local_rate)),
                    share
                        .as_ref()
                        .map_or("-".into(), |s| format!("{} of {}", s.held, s.partitions)),
                    share.as_ref().map_or("-".into(), |s| {
                        if s.store_up { "up" } else { "down: fallback" }.into()
                    }),
                ]);
            }
            before = now;
            println!("t = {:>4.1} s", start.elapsed().as_secs_f64());
            print!(
                "{}",
                text::table(
                    &[
                        "HOST",
                        "SENT pkt/s",
                        "ARRIVED pkt/s",
                        "SHARE pkt/s",
                        "PARTITIONS",
                        "STORE"
                    ],
                    &rows
                )
            );
            println!(
                "fleet: {} pkt/s arrived; budget {} + reserves {}\n",
                count(total.round() as u64),
                count(rate),
                count(reserves)
            );
        }
        for flood in floods {
            flood
                .join()
                .map_err(|_| anyhow::anyhow!("flood thread panicked"))??;
        }
        anyhow::Ok(())
    })
}

/// Packets that arrived at each host so far, counted by nftables.
fn arrivals(fleet: &FleetLab) -> Result<Vec<u64>> {
    fleet
        .hosts
        .iter()
        .map(|lab| Ok(lab.received()?.values().sum()))
        .collect()
}
