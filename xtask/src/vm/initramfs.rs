//! The initramfs.

use std::{
    fmt::Write as _,
    fs::File,
    io::BufWriter,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

use super::{
    Guest,
    cpio::Newc,
    kernels::Unpacked,
    tree::{Entry, Tree},
};

const INIT: &str = include_str!("../../vm/init.sh");

/// Base files the guest gets unless the requested files bring their own.
const ETC: [(&str, &str); 4] = [
    ("/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
    ("/etc/group", "root:x:0:\n"),
    ("/etc/hosts", "127.0.0.1 localhost\n::1 localhost\n"),
    (
        "/etc/nsswitch.conf",
        "passwd: files\ngroup: files\nhosts: files\n",
    ),
];

/// Writes the guest's root: a newc cpio the kernel unpacks into its
/// rootfs. Written here rather than by `cpio`, so host files go in
/// straight from their paths and /dev/console needs no mknod.
pub(super) fn write_initramfs(
    to: &Path,
    guest: &Guest,
    kernel: &Unpacked,
    modules: &[(String, PathBuf)],
    nonce: &str,
) -> Result<()> {
    let mut tree = Tree::default();
    for dir in ["/proc", "/sys", "/dev", "/run", "/tmp", "/root", "/vm/ko"] {
        tree.dir(Path::new(dir));
    }
    // The kernel opens it for init's output before init mounts devtmpfs.
    tree.insert("/dev/console", Entry::CharDevice(5, 1));
    tree.insert("/init", Entry::Bytes(INIT.as_bytes().to_vec(), 0o755));
    let busybox = crate::setup::which("busybox").context("busybox is not installed")?;
    tree.host_file_as(Path::new("/vm/busybox"), &busybox)?;
    for (name, ko) in modules {
        tree.host_file_as(&Path::new("/vm/ko").join(format!("{name}.ko")), ko)?;
    }
    // Where `bpftool feature probe` (and libbpf's Kconfig externs) look.
    let config = format!("config-{}", kernel.release);
    let boot = kernel.vmlinuz.with_file_name(&config);
    if boot.exists() {
        tree.host_file_as(&Path::new("/boot").join(&config), &boot)?;
    }
    // iproute2's own `ip` (busybox's cannot make veth pairs), nft, the
    // host's /bin/sh, and the setsid that starts the commands: a program
    // that busybox starts, or a script its sh runs, would get busybox's
    // applet for any name it has (`ip` included), whatever PATH says.
    let setsid = host_tool("setsid")?;
    for tool in [host_tool("ip")?, setsid.clone(), PathBuf::from("/bin/sh")] {
        tree.host_path(&tool)?;
    }
    if let Some(nft) = crate::setup::which("nft") {
        tree.host_path(&nft)?;
    }
    for file in &guest.files {
        tree.host_path(file)?;
    }
    for command in &guest.commands {
        if let Some(cwd) = &command.cwd {
            tree.guest_dir(cwd)?;
        }
    }
    for (path, text) in ETC {
        if !tree.entries.contains_key(Path::new(path)) {
            tree.insert(path, Entry::Bytes(text.as_bytes().to_vec(), 0o644));
        }
    }
    let job = job_script(guest, modules, nonce, &setsid)?;
    tree.insert("/vm/job.sh", Entry::Bytes(job.into_bytes(), 0o644));
    tree.libraries()?;
    let file = File::create(to).with_context(|| format!("creating {}", to.display()))?;
    let mut out = Newc::new(BufWriter::new(file));
    tree.write(&mut out)?;
    out.finish()
}

fn host_tool(name: &str) -> Result<PathBuf> {
    crate::setup::which(name).with_context(|| format!("{name} is not installed on the host"))
}

/// `/vm/job.sh`: the nonce, the modules to load and the commands to run
/// (the functions init.sh calls).
fn job_script(
    guest: &Guest,
    modules: &[(String, PathBuf)],
    nonce: &str,
    setsid: &Path,
) -> Result<String> {
    let mut script = format!(
        "NONCE={nonce}\nSETSID={}\nmodules() {{\n    :\n",
        shell_quote(&setsid.to_string_lossy())
    );
    for (name, _) in modules {
        writeln!(script, "    load {name}")?;
    }
    script.push_str("}\ncommands() {\n    :\n");
    for (name, value) in &guest.env {
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            bail!("{name:?} is not an environment variable's name");
        }
        writeln!(script, "    export {name}={}", shell_quote(value))?;
    }
    for (index, command) in guest.commands.iter().enumerate() {
        if command.argv.is_empty() {
            bail!("command {:?} has no program", command.name);
        }
        let cwd = command.cwd.as_deref().unwrap_or(Path::new("/"));
        let argv: Vec<String> = command.argv.iter().map(|a| shell_quote(a)).collect();
        writeln!(
            script,
            "    run {index} {} {} {}",
            command.timeout.as_millis().div_ceil(1000).max(1),
            shell_quote(&cwd.to_string_lossy()),
            argv.join(" ")
        )?;
    }
    script.push_str("}\n");
    Ok(script)
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_for_the_shell() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
