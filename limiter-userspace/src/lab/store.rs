//! A `redis-server` of our own for the fleet lab and the tests: listening
//! only where we say (in a namespace of ours, or on loopback), never
//! persisting anything, its password (if any) given on standard input so
//! no command line shows it. It can be stopped and started again on the
//! same address, as an operator's Redis restarts.

use std::{
    io::Write,
    net::{IpAddr, SocketAddr, TcpStream},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::netns;

pub struct RedisServer {
    child: Option<Child>,
    /// The namespace it runs in (`None`: ours).
    netns: Option<String>,
    binds: Vec<IpAddr>,
    pub port: u16,
    password: Option<String>,
    tls: Option<Tls>,
    /// More configuration lines.
    extra: String,
}

/// Redis speaking TLS only: its certificate and key, the CA clients'
/// certificates must come from, and whether they must show one.
#[derive(Clone, Debug)]
pub struct Tls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub ca: std::path::PathBuf,
    pub auth_clients: bool,
}

impl RedisServer {
    /// Starts Redis on `binds`:`port` (port 0: a free loopback port) in
    /// `netns`, and waits until it accepts connections.
    pub fn start(
        netns: Option<&str>,
        binds: &[IpAddr],
        port: u16,
        password: Option<&str>,
    ) -> Result<Self> {
        Self::start_tls(netns, binds, port, password, None)
    }

    /// [`RedisServer::start`], speaking TLS only if `tls` says so.
    pub fn start_tls(
        netns: Option<&str>,
        binds: &[IpAddr],
        port: u16,
        password: Option<&str>,
        tls: Option<Tls>,
    ) -> Result<Self> {
        let port = match port {
            0 => std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port(),
            p => p,
        };
        let mut server = Self {
            child: None,
            netns: netns.map(str::to_owned),
            binds: binds.to_vec(),
            port,
            password: password.map(str::to_owned),
            tls,
            extra: String::new(),
        };
        server.resume()?;
        Ok(server)
    }

    /// `redis://first-bind:port/` (`rediss://` with TLS).
    pub fn url(&self) -> String {
        let addr = SocketAddr::new(self.binds[0], self.port);
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://{addr}/")
    }

    /// Starts it again (on the same address) if stopped.
    pub fn resume(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let binds: Vec<String> = self.binds.iter().map(ToString::to_string).collect();
        let mut config = format!("bind {}\nsave \"\"\nappendonly no\n", binds.join(" "));
        match &self.tls {
            None => config += &format!("port {}\n", self.port),
            Some(tls) => {
                config += &format!(
                    "port 0\ntls-port {}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\ntls-auth-clients {}\n",
                    self.port,
                    tls.cert.display(),
                    tls.key.display(),
                    tls.ca.display(),
                    if tls.auth_clients { "yes" } else { "no" }
                )
            }
        }
        if let Some(password) = &self.password {
            config += &format!("requirepass {password}\n");
        }
        config += &self.extra;
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "redis-server", "-"]);
                c
            }
            None => {
                let mut c = Command::new("redis-server");
                c.arg("-");
                c
            }
        };
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .context("starting redis-server (is it installed?)")?;
        child
            .stdin
            .take()
            .context("redis-server's stdin")?
            .write_all(config.as_bytes())?;
        self.child = Some(child);
        let addr = SocketAddr::new(self.binds[0], self.port);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let connect = || TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok();
            let answered = match &self.netns {
                Some(ns) => netns::enter(ns, connect)?,
                None => connect(),
            };
            if answered {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                bail!("redis-server exited ({status}) before listening on {addr}");
            }
            if Instant::now() > deadline {
                bail!("redis-server did not listen on {addr} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops it at once (SIGKILL: no goodbye to the clients).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Redis Cluster of our own on loopback: `nodes` masters (no replicas),
/// their node files in a directory of the caller's.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(nodes: usize, dir: &std::path::Path) -> Result<Self> {
        let mut servers = Vec::with_capacity(nodes);
        for _ in 0..nodes {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let mut server = Self::node(port, dir);
            server.resume()?;
            servers.push(server);
        }
        let addrs: Vec<String> = servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        netns::run("redis-cli", &args).context("creating the cluster with redis-cli")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        for server in &servers {
            loop {
                let info = netns::run(
                    "redis-cli",
                    &["-p", &server.port.to_string(), "cluster", "info"],
                )?;
                if info.contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("the cluster was not ready within 20 s:\n{info}");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(Self { nodes: servers })
    }

    fn node(port: u16, dir: &std::path::Path) -> RedisServer {
        RedisServer {
            child: None,
            netns: None,
            binds: vec![std::net::Ipv4Addr::LOCALHOST.into()],
            port,
            password: None,
            tls: None,
            extra: format!(
                "cluster-enabled yes\ncluster-config-file nodes-{port}.conf\ncluster-node-timeout 5000\ndir {}\n",
                dir.display()
            ),
        }
    }

    /// `redis://` of its first node.
    pub fn url(&self) -> String {
        self.nodes[0].url()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made
/// with openssl in `dir` (for the TLS tests): the server's files as [`Tls`]
/// (clients must show a certificate), and the client's certificate and key.
pub fn certificates(
    dir: &std::path::Path,
) -> Result<(Tls, std::path::PathBuf, std::path::PathBuf)> {
    let run = |args: &[&str]| -> Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .context("running openssl (is it installed?)")?;
        if !out.status.success() {
            bail!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let ca = [
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=limiter test CA",
    ];
    run(&[&["req", "-x509"][..], &key, &ca].concat())?;
    // With extensions, so the certificates are X.509 v3 (webpki takes no other).
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )?;
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")?;
    for name in ["server", "client"] {
        let file = |ext: &str| format!("{name}.{ext}");
        let subject = format!("/CN={name}");
        let request = [
            "-keyout",
            &file("key"),
            "-out",
            &file("csr"),
            "-subj",
            &subject,
        ];
        run(&[&["req"][..], &key, &request].concat())?;
        run(&[
            "x509",
            "-req",
            "-in",
            &file("csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &file("crt"),
            "-days",
            "2",
            "-extfile",
            &file("ext"),
        ])?;
    }
    let tls = Tls {
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
        ca: dir.join("ca.crt"),
        auth_clients: true,
    };
    Ok((tls, dir.join("client.crt"), dir.join("client.key")))
}
