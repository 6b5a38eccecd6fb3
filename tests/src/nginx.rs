//! A real nginx as the layer-7 tests' upstream: in the foreground, on a
//! loopback port of its own, its access log one JSON object a request
//! (what it routed: `$host`, `$uri`, and the `X-Api-Key` field), so a test
//! counts what reached it and compares what it routed.

use std::{
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::TempDir;

/// nginx, killed on drop.
pub struct Nginx {
    child: Child,
    pub addr: SocketAddr,
    pub log: PathBuf,
}

impl Nginx {
    /// Starts nginx with its files in `dir`, answering every request `ok`.
    pub fn start(dir: &TempDir) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("a free port")
            .local_addr()
            .expect("its address")
            .port();
        let root = dir.0.display();
        let log = dir.0.join("access.log");
        let conf = format!(
            r#"daemon off;
master_process off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log;
events {{ worker_connections 256; }}
http {{
  client_body_temp_path {root}/body;
  proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fastcgi;
  uwsgi_temp_path {root}/uwsgi;
  scgi_temp_path {root}/scgi;
  log_format routed escape=json '{{"host":"$host","uri":"$uri","key":"$http_x_api_key"}}';
  server {{
    listen 127.0.0.1:{port};
    server_name _;
    access_log {log} routed;
    location / {{ return 200 "ok\n"; }}
  }}
}}
"#,
            log = log.display()
        );
        let path = dir.write("nginx.conf", &conf);
        let child = Command::new("nginx")
            .args(["-p", &root.to_string(), "-c", &path.to_string_lossy()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx (cargo xtask setup installs nginx-light)");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "nginx did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, addr, log }
    }

    /// What it routed so far, a request a line: (`$host`, `$uri`, the key).
    pub fn routed(&self) -> Vec<(String, String, String)> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|line| {
                let v: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
                let field = |name: &str| v[name].as_str().unwrap_or_default().to_owned();
                (field("host"), field("uri"), field("key"))
            })
            .collect()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
