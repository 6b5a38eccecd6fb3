//! `limiter proxy` against nginx `limit_req`, side by side in one run
//! (`cargo xtask bench proxy`): both in front of the same upstream (an
//! nginx answering `ok` itself), both limiting each client to 1,000,000
//! requests/s with a burst of 1,000 (so nothing is refused: this is the
//! cost of a limiter in the path), both keeping connections to the
//! upstream alive, both with one worker per CPU. wrk (2 threads, 64
//! connections) loads each in turn, in interleaved rounds; throughput and
//! latency are wrk's, CPU per response is the limiter's processes' CPU
//! time (from /proc) over the responses wrk counted, also split into its
//! userspace and kernel parts (where the two differ is where the gap is).
//!
//! `--quick`: one round of 3 s. Results go to target/bench/proxy.json.

use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use limiter_tests::{TempDir, free_loopback_addr, limiter_bin, machine};
use serde_json::json;

const CONNECTIONS: u32 = 64;
const RATE: u64 = 1_000_000;
const BURST: u64 = 1_000;

/// A server process, stopped on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        // nginx stops its workers on SIGTERM (its master does).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(mut command: Command, addr: String, what: &str) -> Result<Self> {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let server = Self { child, addr };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(&server.addr).is_err() {
            if Instant::now() > deadline {
                bail!("{what} did not listen on {}", server.addr);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    /// CPU time of the process and its children's processes (nginx's
    /// workers), so far.
    fn cpu(&self) -> Cpu {
        let pid = self.child.id();
        let mut pids = vec![pid];
        if let Ok(children) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
            pids.extend(
                children
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        let (user, system) = pids
            .iter()
            .map(|p| cpu_ticks(*p))
            .fold((0, 0), |(u, s), (pu, ps)| (u + pu, s + ps));
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        let time = |ticks: u64| Duration::from_nanos(ticks * 1_000_000_000 / hz);
        Cpu {
            user: time(user),
            system: time(system),
        }
    }
}

/// CPU time, split: the process's own code, and the kernel's on its
/// behalf (here mostly TCP on loopback).
#[derive(Clone, Copy, Debug)]
struct Cpu {
    user: Duration,
    system: Duration,
}

impl Cpu {
    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            user: self.user.saturating_sub(before.user),
            system: self.system.saturating_sub(before.system),
        }
    }

    fn total(self) -> Duration {
        self.user + self.system
    }
}

/// utime and stime of `pid`, in clock ticks (all its threads).
fn cpu_ticks(pid: u32) -> (u64, u64) {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (0, 0);
    };
    // Fields after the command name (which may hold spaces), from `state`.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime is field 14 of stat, stime 15: 12 and 13 after the name.
    (field(11), field(12))
}

fn nginx(dir: &Path, name: &str, workers: &str, http: &str) -> Result<(Command, String)> {
    let addr = free_loopback_addr();
    let conf = format!(
        "worker_processes {workers};\n\
         pid {dir}/{name}.pid;\n\
         error_log {dir}/{name}.err warn;\n\
         daemon off;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n\
           client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fcgi;\n\
           uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;\n\
           {http}\n\
           server {{ listen {addr}; keepalive_requests 1000000; {{LOCATION}} }}\n\
         }}\n",
        dir = dir.display(),
    );
    let path = dir.join(format!("{name}.conf"));
    Ok((
        {
            let location = if name == "upstream" {
                "location / { return 200 \"ok\\n\"; }".to_owned()
            } else {
                "location / { limit_req zone=clients burst=1000 nodelay; proxy_pass http://up; \
                 proxy_http_version 1.1; proxy_set_header Connection \"\"; }"
                    .to_owned()
            };
            std::fs::write(&path, conf.replace("{LOCATION}", &location))?;
            let mut command = Command::new("nginx");
            command.arg("-c").arg(&path);
            command
        },
        addr,
    ))
}

/// What wrk measured.
#[derive(Clone, Copy, Debug)]
struct Run {
    requests_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    responses: u64,
    errors: u64,
}

fn wrk(addr: &str, duration: Duration) -> Result<Run> {
    let out = Command::new("wrk")
        .args([
            "-t2",
            &format!("-c{CONNECTIONS}"),
            &format!("-d{}s", duration.as_secs()),
            "--latency",
            &format!("http://{addr}/"),
        ])
        .output()
        .context("running wrk (cargo xtask setup installs it)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |prefix: &str| {
        text.lines()
            .map(str::trim)
            .find(|l| l.starts_with(prefix))
            .map(str::to_owned)
    };
    let ms = |value: &str| -> f64 {
        let value = value.trim();
        if let Some(v) = value.strip_suffix("ms") {
            v.parse().unwrap_or(f64::NAN)
        } else if let Some(v) = value.strip_suffix("us") {
            v.parse::<f64>().map_or(f64::NAN, |v| v / 1000.0)
        } else if let Some(v) = value.strip_suffix('s') {
            v.parse::<f64>().map_or(f64::NAN, |v| v * 1000.0)
        } else {
            f64::NAN
        }
    };
    let after = |prefix: &str| {
        line(prefix)
            .and_then(|l| l.strip_prefix(prefix).map(str::to_owned))
            .unwrap_or_default()
    };
    // "123456 requests in 10.00s, 12.3MB read"
    let responses = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let errors = after("Non-2xx or 3xx responses:")
        .trim()
        .parse()
        .unwrap_or(0);
    let run = Run {
        requests_per_sec: after("Requests/sec:").trim().parse().unwrap_or(0.0),
        p50_ms: ms(&after("50%")),
        p99_ms: ms(&after("99%")),
        responses,
        errors,
    };
    if run.requests_per_sec == 0.0 {
        bail!("wrk measured nothing:\n{text}");
    }
    Ok(run)
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (rounds, duration) = if quick {
        (1, Duration::from_secs(3))
    } else {
        (3, Duration::from_secs(10))
    };
    let dir = TempDir::new("bench-proxy");
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (upstream_cmd, upstream_addr) = nginx(&dir.0, "upstream", "1", "")?;
    let upstream = Server::start(upstream_cmd, upstream_addr, "the upstream nginx")?;
    let http = format!(
        "limit_req_zone $binary_remote_addr zone=clients:10m rate={RATE}r/s;\n\
         upstream up {{ server {}; keepalive 64; }}",
        upstream.addr
    );
    let (nginx_cmd, nginx_addr) = nginx(&dir.0, "limit_req", &workers.to_string(), &http)?;
    let nginx = Server::start(nginx_cmd, nginx_addr, "nginx limit_req")?;
    let rules: PathBuf = dir.0.join("rules.yaml");
    std::fs::write(
        &rules,
        format!(
            "rules:\n  - {{ name: clients, limit: {{ rate: {RATE}, unit: second, burst: {BURST} }} }}\n"
        ),
    )?;
    let proxy_addr = free_loopback_addr();
    let mut proxy_cmd = Command::new(limiter_bin());
    proxy_cmd
        .args(["proxy", "--listen", &proxy_addr, "--upstream"])
        .arg(format!("http://{}", upstream.addr))
        .arg("--config")
        .arg(&rules)
        .env("RUST_LOG", "warn");
    let proxy = Server::start(proxy_cmd, proxy_addr, "limiter proxy")?;
    let peers = [("nginx limit_req", &nginx), ("limiter proxy", &proxy)];
    println!(
        "limiter proxy against nginx limit_req: {} connections, {} s x {rounds} interleaved rounds, upstream nginx on loopback, {}",
        CONNECTIONS,
        duration.as_secs(),
        machine()
    );
    let per_response = |r: &Run, d: Duration| d.as_secs_f64() * 1e6 / r.responses.max(1) as f64;
    let mut runs: Vec<Vec<(Run, Cpu)>> = vec![Vec::new(); peers.len()];
    // A short warm-up of each (connections to the upstream, caches).
    for (_, server) in &peers {
        wrk(&server.addr, Duration::from_secs(1))?;
    }
    for round in 0..rounds {
        for (i, (name, server)) in peers.iter().enumerate() {
            let before = server.cpu();
            let run = wrk(&server.addr, duration)?;
            let cpu = server.cpu().since(before);
            println!(
                "  round {}: {name:<16} {:>9.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  {:>5.1} us CPU/response ({:>4.1} user){}",
                round + 1,
                run.requests_per_sec,
                run.p50_ms,
                run.p99_ms,
                per_response(&run, cpu.total()),
                per_response(&run, cpu.user),
                if run.errors > 0 {
                    format!("  ({} non-2xx!)", run.errors)
                } else {
                    String::new()
                }
            );
            runs[i].push((run, cpu));
        }
    }
    let summary: Vec<(f64, f64, f64, f64, u64, f64, f64)> = runs
        .iter()
        .map(|rs| {
            let mut by_total: Vec<&(Run, Cpu)> = rs.iter().collect();
            by_total.sort_by(|a, b| {
                per_response(&a.0, a.1.total()).total_cmp(&per_response(&b.0, b.1.total()))
            });
            // The round whose CPU per response is the median, and its
            // split, so that the parts add up to it.
            let (run, cpu) = by_total[by_total.len() / 2];
            (
                limiter_tests::median(
                    &rs.iter()
                        .map(|(r, _)| r.requests_per_sec)
                        .collect::<Vec<_>>(),
                ),
                limiter_tests::median(&rs.iter().map(|(r, _)| r.p50_ms).collect::<Vec<_>>()),
                limiter_tests::median(&rs.iter().map(|(r, _)| r.p99_ms).collect::<Vec<_>>()),
                per_response(run, cpu.total()),
                rs.iter().map(|(r, _)| r.errors).sum(),
                per_response(run, cpu.user),
                per_response(run, cpu.system),
            )
        })
        .collect();
    println!(
        "\n| | nginx limit_req | limiter proxy | limiter / nginx |\n| --- | --- | --- | --- |"
    );
    let (n, l) = (summary[0], summary[1]);
    println!(
        "| requests/s (median) | {:.0} | {:.0} | {:.2} |",
        n.0,
        l.0,
        l.0 / n.0
    );
    println!(
        "| p50 latency | {:.2} ms | {:.2} ms | {:.2} |",
        n.1,
        l.1,
        l.1 / n.1
    );
    println!(
        "| p99 latency | {:.2} ms | {:.2} ms | {:.2} |",
        n.2,
        l.2,
        l.2 / n.2
    );
    println!(
        "| CPU per response | {:.1} us | {:.1} us | {:.2} |",
        n.3,
        l.3,
        l.3 / n.3
    );
    println!(
        "| of which userspace | {:.1} us | {:.1} us | {:.2} |",
        n.5,
        l.5,
        l.5 / n.5
    );
    println!(
        "| of which kernel | {:.1} us | {:.1} us | {:.2} |",
        n.6,
        l.6,
        l.6 / n.6
    );
    println!("| non-2xx responses | {} | {} | |", n.4, l.4);
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&out)?;
    let results = json!({
        "machine": machine(),
        "rounds": rounds,
        "seconds": duration.as_secs(),
        "connections": CONNECTIONS,
        "peers": peers.iter().zip(&runs).map(|((name, _), rs)| json!({
            "name": name,
            "runs": rs.iter().map(|(r, c)| json!({
                "requests_per_sec": r.requests_per_sec,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "responses": r.responses,
                "non_2xx": r.errors,
                "cpu_seconds": c.total().as_secs_f64(),
                "user_seconds": c.user.as_secs_f64(),
                "system_seconds": c.system.as_secs_f64(),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    std::fs::write(
        out.join("proxy.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    drop((proxy, nginx, upstream));
    Ok(())
}
