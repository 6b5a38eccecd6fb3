//! Kernels: Debian's packages, in a cache outside the repository.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::{
    Kernel,
    util::{captured, file_name, quiet, read_dir},
};

/// Where kernels and apt lists are kept, per suite: outside the
/// repository, so a fresh clone on the same machine reuses them.
fn cache_root() -> PathBuf {
    std::env::var_os("LIMITER_VM_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/limiter-vm"), PathBuf::from)
}

/// A kernel package unpacked in the cache.
pub(super) struct Unpacked {
    /// Its `uname -r`.
    pub(super) release: String,
    pub(super) vmlinuz: PathBuf,
    /// `lib/modules/<release>` inside it.
    pub(super) modules: PathBuf,
    /// Where modules are kept decompressed.
    pub(super) decompressed: PathBuf,
}

/// The newest package of `kernel` that the cache has unpacked, or else
/// the newest the mirror serves, downloaded and unpacked once. The lists
/// are fetched only when missing (then what is unpacked stays what is
/// booted), or when no package they name can be downloaded any more
/// (kernel updates replace their predecessors).
pub(super) fn unpack(kernel: &Kernel) -> Result<Unpacked> {
    let apt = Apt::open(kernel.suite)?;
    let mut refreshed = !apt.has_lists();
    if refreshed {
        apt.update()?;
    }
    loop {
        let candidates = apt.candidates(kernel.package)?;
        let unpacked = candidates
            .iter()
            .map(|package| apt.dir.join(package))
            .find(|dir| dir.join(COMPLETE).exists());
        if let Some(dir) = unpacked {
            return Unpacked::find(&dir);
        }
        // A mirror may lack some (this machine's answers 404 for every
        // bullseye-security kernel): the next newest, then.
        let mut failure = None;
        for package in &candidates {
            crate::step(&format!(
                "fetching {package} (Debian {}, {})",
                kernel.debian, kernel.suite
            ));
            let dir = apt.dir.join(package);
            match apt.download_and_unpack(package, &dir) {
                Ok(()) => {
                    apt.remove_other_kernels(package);
                    return Unpacked::find(&dir);
                }
                Err(e) => {
                    println!("xtask: {e:#}");
                    failure = Some(e);
                }
            }
        }
        let failure = failure.context("no package to fetch")?;
        if refreshed {
            return Err(failure.context(format!("fetching a {} kernel", kernel.name)));
        }
        apt.update()?;
        refreshed = true;
    }
}

/// Marks a completely unpacked package directory.
const COMPLETE: &str = ".complete";

impl Unpacked {
    fn find(dir: &Path) -> Result<Self> {
        let boot = dir.join("boot");
        let vmlinuz = read_dir(&boot)?
            .into_iter()
            .find(|p| file_name(p).starts_with("vmlinuz-"))
            .with_context(|| format!("no vmlinuz-* in {}", boot.display()))?;
        let release = file_name(&vmlinuz)["vmlinuz-".len()..].to_owned();
        // bullseye's packages predate the merged /usr.
        let modules = ["usr/lib/modules", "lib/modules"]
            .iter()
            .map(|base| dir.join(base).join(&release))
            .find(|p| p.is_dir())
            .with_context(|| format!("no lib/modules/{release} in {}", dir.display()))?;
        Ok(Self {
            release,
            vmlinuz,
            modules,
            decompressed: dir.join("decompressed-modules"),
        })
    }
}

/// apt with a state of its own for one suite: the host's mirrors, another
/// release, nothing of the host's own apt state touched.
struct Apt {
    /// `<cache>/<suite>`
    dir: PathBuf,
}

impl Apt {
    fn open(suite: &str) -> Result<Self> {
        let dir = cache_root().join(suite);
        for sub in ["lists/partial", "apt/archives/partial"] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path)
                .with_context(|| format!("creating {}", path.display()))?;
        }
        let list = host_sources(suite)?;
        std::fs::write(dir.join("sources.list"), list)
            .with_context(|| format!("writing {}", dir.join("sources.list").display()))?;
        Ok(Self { dir })
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        let d = |sub: &str| self.dir.join(sub).display().to_string();
        for option in [
            format!("Dir::Etc::SourceList={}", d("sources.list")),
            "Dir::Etc::SourceParts=/dev/null".to_owned(),
            format!("Dir::State::Lists={}", d("lists")),
            format!("Dir::Cache={}", d("apt")),
            // The cache belongs to root; apt's `_apt` user may not write it.
            "APT::Sandbox::User=root".to_owned(),
        ] {
            command.arg("-o").arg(option);
        }
        command
    }

    fn has_lists(&self) -> bool {
        read_dir(&self.dir.join("lists"))
            .is_ok_and(|files| files.iter().any(|p| file_name(p).contains("_Packages")))
    }

    fn update(&self) -> Result<()> {
        crate::step(&format!(
            "apt lists of {} (kept in {})",
            file_name(&self.dir),
            self.dir.display()
        ));
        quiet(self.command("apt-get").args(["-q", "update"]))
    }

    /// The packages whose names match `pattern`, newest first.
    fn candidates(&self, pattern: &str) -> Result<Vec<String>> {
        let out = captured(
            self.command("apt-cache")
                .args(["search", "--names-only"])
                .arg(glob_regex(pattern)),
        )?;
        let mut names: Vec<&str> = out
            .lines()
            .filter_map(|line| line.split(" - ").next())
            .filter(|name| glob_match(pattern, name))
            .collect();
        if names.is_empty() {
            bail!("no package matches {pattern} in {}", self.dir.display());
        }
        names.sort_by_cached_key(|name| std::cmp::Reverse(natural_key(name)));
        Ok(names.into_iter().map(str::to_owned).collect())
    }

    /// Downloads `package` and unpacks it into `dir` (through a temporary
    /// directory, so an interrupted run leaves no half-unpacked kernel).
    fn download_and_unpack(&self, package: &str, dir: &Path) -> Result<()> {
        let partial = self.dir.join(format!("{package}.partial"));
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial)?;
        let out = self
            .command("apt-get")
            .args(["-q", "download", package])
            .current_dir(&partial)
            .output()
            .context("starting apt-get download")?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = stderr.lines().rfind(|l| l.starts_with("E:")).unwrap_or("");
            bail!("apt-get download {package} failed: {why}");
        }
        let deb = read_dir(&partial)?
            .into_iter()
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .context("apt-get download left no .deb")?;
        let root = partial.join("root");
        quiet(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        std::fs::write(root.join(COMPLETE), "")?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&root, dir)
            .with_context(|| format!("moving the unpacked kernel to {}", dir.display()))?;
        let _ = std::fs::remove_dir_all(&partial);
        Ok(())
    }

    /// Earlier kernels of this suite (about 150 MB each unpacked).
    fn remove_other_kernels(&self, keep: &str) {
        for dir in read_dir(&self.dir).unwrap_or_default() {
            let name = file_name(&dir);
            if name.starts_with("linux-image-") && name != keep && dir.is_dir() {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

/// The host's Debian mirrors (the `URIs:` of its deb822 sources), as
/// one-line sources for `suite`: each suite of the host's release renamed
/// to `suite`'s (`bookworm-security` becomes `trixie-security`).
fn host_sources(suite: &str) -> Result<String> {
    const SOURCES: &str = "/etc/apt/sources.list.d/debian.sources";
    let text = std::fs::read_to_string(SOURCES).with_context(|| format!("reading {SOURCES}"))?;
    let host = host_codename()?;
    let mut lines = BTreeSet::new();
    for stanza in text.split("\n\n") {
        let field = |name: &str| -> Vec<String> {
            stanza
                .lines()
                .filter_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .flat_map(|v| v.split_whitespace().map(str::to_owned))
                .collect()
        };
        // An inline key (not a path) is left out: apt's keyrings know
        // Debian's keys anyway.
        let options = match field("Signed-By").first() {
            Some(path) if path.starts_with('/') => format!("[signed-by={path}] "),
            _ => String::new(),
        };
        for uri in field("URIs") {
            for host_suite in field("Suites") {
                if let Some(rest) = host_suite.strip_prefix(&host) {
                    lines.insert(format!("deb {options}{uri} {suite}{rest} main\n"));
                }
            }
        }
    }
    if lines.is_empty() {
        bail!("{SOURCES} names no mirror of {host}'s suites");
    }
    Ok(lines.into_iter().collect())
}

/// The host's Debian codename (`bookworm`).
fn host_codename() -> Result<String> {
    let text = std::fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .filter(|v| !v.is_empty())
        .context("/etc/os-release has no VERSION_CODENAME")
}

/// `*` matches any run of characters; nothing else is special.
fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .any(|i| glob_match(tail, &rest[i..]))
        }
    }
}

/// The glob as a POSIX regular expression for `apt-cache search`.
fn glob_regex(pattern: &str) -> String {
    let mut regex = String::from("^");
    for c in pattern.chars() {
        match c {
            '*' => regex.push_str(".*"),
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => regex.push(c),
            c => {
                regex.push('\\');
                regex.push(c);
            }
        }
    }
    regex.push('$');
    regex
}

/// Orders names as versions: runs of digits by value (6.12.10 after 6.12.9).
fn natural_key(name: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = name;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let (number, after) = rest.split_at(digits);
        let text_len = after.len()
            - after
                .trim_start_matches(|c: char| !c.is_ascii_digit())
                .len();
        let (text, after) = after.split_at(text_len);
        key.push((number.parse().unwrap_or(0), text.to_owned()));
        rest = after;
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_package_names() {
        let p = "linux-image-6.12.*+deb13*-cloud-amd64-unsigned";
        assert!(glob_match(
            p,
            "linux-image-6.12.118+deb13-cloud-amd64-unsigned"
        ));
        assert!(glob_match(
            p,
            "linux-image-6.12.115+deb13.1-cloud-amd64-unsigned"
        ));
        assert!(!glob_match(p, "linux-image-6.12.118+deb13-cloud-amd64-dbg"));
        assert!(!glob_match(p, "linux-image-6.12.118+deb13-cloud-amd64"));
        assert_eq!(
            glob_regex("linux-image-6.1.0-*-cloud"),
            r"^linux-image-6\.1\.0-.*-cloud$"
        );
    }

    #[test]
    fn newest_is_by_version() {
        let mut names = [
            "linux-image-6.12.9+deb13-cloud",
            "linux-image-6.12.118+deb13-cloud",
            "linux-image-6.12.115+deb13.1-cloud",
            "linux-image-6.12.115+deb13-cloud",
        ];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names[3], "linux-image-6.12.118+deb13-cloud");
        assert_eq!(names[0], "linux-image-6.12.9+deb13-cloud");
        assert!(natural_key("6.12.115+deb13.1-c") > natural_key("6.12.115+deb13-c"));
    }
}
