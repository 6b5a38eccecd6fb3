//! `limiter`: an XDP per-source rate limiter.

mod commands;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use limiter::{control::DEFAULT_SOCKET, kernel::pins::DEFAULT_PIN_DIR, wire::Mode};

/// The proxy allocates and frees a few small buffers per request (hyper's
/// messages, header maps); mimalloc's per-thread free lists serve them
/// without the locks and consolidation of glibc's malloc, which took 6% of
/// the proxy's CPU under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    version,
    about = "Per-source rate limits in XDP, before the kernel allocates anything"
)]
struct Cli {
    /// How logs are written (stderr): `text` for people, `json` for a log
    /// pipeline (one JSON object a line, with each event's fields).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr, filtered by `LIMITER_LOG` (default `info`).
fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LIMITER_LOG")
        .unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_target(false);
    match format {
        LogFormat::Text => logs
            .without_time()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        // Timestamps (RFC 3339, UTC) and the event's fields at the top level.
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
}

#[derive(Subcommand)]
#[expect(clippy::large_enum_variant, reason = "parsed once per process")]
enum Command {
    /// Attach to interfaces and enforce a rule file until SIGINT/SIGTERM,
    /// then detach (for a service that survives restarts, use `daemon`).
    Run {
        /// Interface to attach to (repeat for several; they share one set of buckets).
        #[arg(long = "iface", required = true)]
        ifaces: Vec<String>,
        /// The rule file (YAML).
        #[arg(long)]
        config: PathBuf,
        /// XDP attach mode: auto tries native, then skb.
        #[arg(long, value_enum, default_value_t = Mode::Auto)]
        mode: Mode,
        /// Where the maps are pinned (below a bpffs mount).
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// How often to print a summary line.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
    /// Run as a service: pinned program, maps and links that outlive the
    /// process; rule changes, blocks and dry runs over the control socket.
    Daemon {
        /// The daemon's configuration (see examples/daemon.yaml).
        #[arg(long)]
        config: PathBuf,
    },
    /// Rule sets of the running daemon.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// Block a source address or prefix (in the kernel, before any rule).
    Block {
        prefix: String,
        /// Lift the block after this long (e.g. 10m); default: never.
        #[arg(long = "for", value_parser = humantime::parse_duration)]
        duration: Option<Duration>,
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Lift a block.
    Unblock {
        prefix: String,
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Switch dry run (count excess, drop nothing) on or off, for one rule or for all.
    Shadow {
        #[arg(value_enum)]
        state: OnOff,
        /// Only this rule (until the next rule file is applied).
        #[arg(long)]
        rule: Option<String>,
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Remove the limiter from every interface and remove every pin.
    Detach {
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Print the counters of the running limiter (daemon or `run`).
    Stats {
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Refresh every second.
        #[arg(long)]
        watch: bool,
        /// Asked first: the daemon's control socket.
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Live view of the sources with the most drops and their rates.
    Top {
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// How many sources to show.
        #[arg(long, short = 'n', default_value_t = 20)]
        count: usize,
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        interval: Duration,
        /// One sample, then exit.
        #[arg(long)]
        once: bool,
        #[arg(long)]
        json: bool,
    },
    /// Live decisions of the XDP program, like tcpdump for the limiter:
    /// time, interface, source, protocol/port, rule, verdict, the meter
    /// that refused, and what is left of each budget.
    Trace {
        #[command(flatten)]
        filter: TraceArgs,
        /// Stop after this many decisions.
        #[arg(long, short = 'c')]
        count: Option<u64>,
        /// Stop after this long (e.g. 30s).
        #[arg(long, value_parser = humantime::parse_duration)]
        duration: Option<Duration>,
        /// One JSON object a line.
        #[arg(long)]
        json: bool,
        /// Without a daemon: the pins of the limiter to trace.
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Asked first: the daemon's control socket.
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// HTTP reverse proxy applying the rule file to requests (layer 7).
    Proxy(ProxyArgs),
    /// Convert another limiter's configuration into a rule file.
    Import {
        #[command(subcommand)]
        from: ImportFrom,
    },
    /// Validate a rule file without touching the kernel.
    Check {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Demo: build a two-namespace lab, flood it from a few sources and show
    /// what the limiter passes and drops per source; removes the lab after.
    Lab {
        /// Rule file to enforce (default: the built-in example).
        #[arg(long)]
        config: Option<PathBuf>,
        /// How long to flood.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long, value_enum, default_value_t = Mode::Native)]
        mode: Mode,
        /// Three hosts sharing one fleet-wide budget through a Redis of
        /// the lab's own (default rules: examples/fleet.yaml).
        #[arg(long)]
        fleet: bool,
    },
}

/// `limiter proxy`'s options.
#[derive(clap::Args)]
struct ProxyArgs {
    /// Address to listen on (e.g. 127.0.0.1:8080).
    #[arg(long)]
    listen: std::net::SocketAddr,
    /// Where to forward allowed requests (e.g. http://127.0.0.1:3000).
    #[arg(long)]
    upstream: http::Uri,
    /// The rule file (the same one the kernel uses).
    #[arg(long)]
    config: PathBuf,
    /// Key clients by this request header instead of their address.
    #[arg(long)]
    key_header: Option<http::HeaderName>,
    /// Time a client has to send its request headers.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    header_timeout: Duration,
    /// Largest request header block accepted (bytes); larger gets 431.
    #[arg(long, default_value_t = 16384)]
    max_header_bytes: usize,
    /// Connections served at once; one more gets 503.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections served at once from one client address (trusted
    /// proxies excepted); one more gets 503. Default: a quarter of
    /// --max-connections.
    #[arg(long)]
    max_connections_per_source: Option<usize>,
    /// Longest a request body may take in all before the client gets 408
    /// (a body that trickles in never pauses for --body-timeout).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    body_deadline: Duration,
    /// Largest request body (bytes); larger gets 413.
    #[arg(long, default_value_t = 10 << 20)]
    max_body_bytes: u64,
    /// Longest pause in a request body before the client gets 408.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    body_timeout: Duration,
    /// Time the upstream has to answer, once it has the whole request,
    /// before the client gets 502.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    upstream_timeout: Duration,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9465).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// A load balancer or proxy in front (address or prefix; repeat for
    /// several): requests from it are from the client it names in
    /// --forwarded-header. From anyone else, that field is ignored.
    #[arg(long = "trusted-proxy", value_parser = limiter::rules::parse_net)]
    trusted_proxies: Vec<ipnet::IpNet>,
    /// The field the trusted proxies append the client to (the other is
    /// never read: they pass it through as the client wrote it).
    #[arg(long, value_enum, default_value = "x-forwarded-for")]
    forwarded_header: limiter::http::forwarded::ForwardedField,
    /// Serve TLS with this certificate chain (PEM; HTTP/2 or HTTP/1.1
    /// by ALPN); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Re-read the rule file when it changes on disk (SIGHUP always
    /// does); unchanged rules keep their buckets.
    #[arg(long)]
    watch: bool,
    /// Share the rule file's fleet-wide rules through the store this
    /// file names (the daemon's `fleet:` section: store, lease_ttl,
    /// fail_open).
    #[arg(long)]
    fleet: Option<PathBuf>,
    /// Threads serving requests, each with its own listening socket
    /// (SO_REUSEPORT) and upstream connections; 0: one per CPU.
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// Print decisions to stdout as `limiter trace` prints the kernel's
    /// (filtered by the --trace-* options).
    #[arg(long)]
    trace: bool,
    /// Traced: clients in this prefix or this address only.
    #[arg(long, requires = "trace")]
    trace_source: Option<String>,
    /// Traced: this rule only (by name).
    #[arg(long, requires = "trace")]
    trace_rule: Option<String>,
    /// Traced: these verdicts only (passed, dropped, shadow).
    #[arg(long, requires = "trace", value_delimiter = ',')]
    trace_verdict: Vec<String>,
    /// Traced: one decision in N of those that match.
    #[arg(long, requires = "trace", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    trace_sample: u32,
    /// Traced decisions as JSON, one object a line.
    #[arg(long, requires = "trace")]
    trace_json: bool,
}

impl ProxyArgs {
    fn run(self) -> anyhow::Result<()> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(limiter::listen::tls_acceptor(cert, key)?),
            _ => None,
        };
        let trace = if self.trace {
            let filter = TraceArgs {
                source: self.trace_source,
                rule: self.trace_rule,
                verdicts: self.trace_verdict,
                iface: None,
                sample: self.trace_sample,
            }
            .into_filter()?;
            let tracer = limiter::http::trace::HttpTracer::new(
                &filter,
                self.listen.to_string(),
                self.trace_json,
            )?;
            Some(std::sync::Arc::new(tracer))
        } else {
            None
        };
        commands::proxy(
            limiter::http::proxy::Options {
                listen: self.listen,
                upstream: self.upstream,
                key_by: self.key_header.map_or(
                    limiter::http::KeyBy::ClientAddr,
                    limiter::http::KeyBy::Header,
                ),
                header_timeout: self.header_timeout,
                max_header_bytes: self.max_header_bytes,
                max_connections: self.max_connections,
                max_connections_per_source: self
                    .max_connections_per_source
                    .unwrap_or_else(|| limiter::listen::default_per_source(self.max_connections)),
                body_deadline: self.body_deadline,
                max_body_bytes: self.max_body_bytes,
                body_timeout: self.body_timeout,
                upstream_timeout: self.upstream_timeout,
                metrics: self.metrics,
                trusted_proxies: self.trusted_proxies,
                forwarded_field: self.forwarded_header,
                tls,
                workers: self.workers,
                trace,
            },
            &self.config,
            self.fleet.as_deref(),
            self.watch,
        )
    }
}

#[derive(Subcommand)]
enum RulesCommand {
    /// Validate a rule file and switch the daemon to it atomically.
    Apply {
        file: PathBuf,
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// The active rules with their ids and counters, and the blocks.
    Show {
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ImportFrom {
    /// An envoy ratelimit service config (descriptors): prints the rule
    /// file, and on stderr what could not be converted.
    Envoy {
        file: PathBuf,
        /// The route configuration (`virtual_hosts`) whose `rate_limits`
        /// actions produce the descriptors: what each key means.
        #[arg(long)]
        routes: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OnOff {
    On,
    Off,
}

impl Command {
    /// Whether the command serves sockets (or cleans up when it ends).
    fn serves(&self) -> bool {
        matches!(
            self,
            Self::Run { .. } | Self::Daemon { .. } | Self::Proxy(_) | Self::Lab { .. }
        )
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logs(cli.log_format);
    let json_logs = matches!(cli.log_format, LogFormat::Json);
    let command = cli.command;
    if !command.serves() {
        // A reader that went away (`limiter check | head`) ends a command
        // quietly, as it ends other Unix tools. Servers keep Rust's ignored
        // SIGPIPE: a client hanging up is an EPIPE on its own socket.
        // SAFETY: setting a signal disposition before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match command {
        Command::Run {
            ifaces,
            config,
            mode,
            pin_dir,
            interval,
        } => commands::run::run(&ifaces, &config, mode, &pin_dir, interval),
        Command::Daemon { config } => limiter::daemon::run(&config),
        Command::Rules {
            command: RulesCommand::Apply { file, socket, json },
        } => commands::rules_apply(&file, &socket, json),
        Command::Rules {
            command: RulesCommand::Show { socket, json },
        } => commands::rules_show(&socket, json),
        Command::Block {
            prefix,
            duration,
            socket,
        } => commands::block(&socket, prefix, duration),
        Command::Unblock { prefix, socket } => commands::unblock(&socket, prefix),
        Command::Shadow {
            state,
            rule,
            socket,
        } => commands::shadow(&socket, rule, matches!(state, OnOff::On)),
        Command::Detach { pin_dir, socket } => commands::detach(&pin_dir, &socket),
        Command::Stats {
            pin_dir,
            json,
            watch,
            socket,
        } => commands::stats(&pin_dir, &socket, json, watch),
        Command::Top {
            pin_dir,
            count,
            interval,
            once,
            json,
        } => commands::top::run(&pin_dir, count, interval, once, json),
        Command::Trace {
            filter,
            count,
            duration,
            json,
            pin_dir,
            socket,
        } => filter.into_filter().and_then(|filter| {
            commands::trace::run(commands::trace::Trace {
                pin_dir: &pin_dir,
                socket: &socket,
                filter,
                count,
                duration,
                json,
            })
        }),
        Command::Check { config, json } => commands::check(&config, json),
        Command::Import {
            from: ImportFrom::Envoy { file, routes },
        } => commands::import_envoy(&file, routes.as_deref()),
        Command::Proxy(args) => args.run(),
        Command::Lab {
            config,
            duration,
            mode: _,
            fleet: true,
        } => commands::lab_fleet::run(config.as_deref(), duration),
        Command::Lab {
            config,
            duration,
            mode,
            fleet: false,
        } => commands::lab::run(config.as_deref(), duration, mode),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if json_logs => {
            tracing::error!(event = "exit", error = %format!("{e:#}"), "exiting on an error");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Which decisions `limiter trace` (and `limiter proxy --trace`) shows.
#[derive(clap::Args, Debug, Clone, Default)]
struct TraceArgs {
    /// Sources in this prefix or this address only (198.18.0.1, 198.18.0.0/16).
    #[arg(long)]
    source: Option<String>,
    /// This rule only (by name).
    #[arg(long)]
    rule: Option<String>,
    /// These verdicts only: passed, dropped, shadow, blocked, malformed
    /// (comma-separated or repeated).
    #[arg(long = "verdict", value_delimiter = ',')]
    verdicts: Vec<String>,
    /// This interface only (kernel).
    #[arg(long)]
    iface: Option<String>,
    /// Show one decision in N of those that match, so a trace is safe
    /// under a flood.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    sample: u32,
}

impl TraceArgs {
    fn into_filter(self) -> anyhow::Result<limiter::trace::TraceFilter> {
        let filter = limiter::trace::TraceFilter {
            source: self
                .source
                .as_deref()
                .map(limiter::trace::parse_source)
                .transpose()?,
            rule: self.rule,
            verdicts: self.verdicts,
            iface: self.iface,
            sample: self.sample,
        };
        // Checked here, before any tracing starts.
        filter.config(None, 0)?;
        Ok(filter)
    }
}
