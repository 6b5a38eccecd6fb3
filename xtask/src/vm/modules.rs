//! Modules: those a guest loads, and what they depend on.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use super::{
    kernels::Unpacked,
    util::{captured, quiet, read_dir},
};

/// `names` and the modules they depend on, dependencies first, as
/// decompressed files; those built into the kernel are left out.
pub(super) fn resolve_modules(
    kernel: &Unpacked,
    names: &[String],
) -> Result<Vec<(String, PathBuf)>> {
    let index = ModuleIndex::read(kernel)?;
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    for name in names {
        let (name, optional) = match name.strip_suffix('?') {
            Some(name) => (normalize(name), true),
            None => (normalize(name), false),
        };
        if optional && !index.files.contains_key(&name) {
            continue;
        }
        index.visit(kernel, &name, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// Module names, as the kernel compares them (`-` and `_` alike).
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

struct ModuleIndex {
    files: HashMap<String, PathBuf>,
    builtin: HashSet<String>,
}

impl ModuleIndex {
    /// The package has no modules.dep (depmod writes it at install): every
    /// module file is indexed by name, and `modinfo` gives dependencies.
    fn read(kernel: &Unpacked) -> Result<Self> {
        let mut files = HashMap::new();
        let mut dirs = vec![kernel.modules.join("kernel")];
        while let Some(dir) = dirs.pop() {
            for path in read_dir(&dir)? {
                if path.is_dir() {
                    dirs.push(path);
                } else if let Some(name) = module_name(&path) {
                    files.insert(name, path);
                }
            }
        }
        let builtin_list = kernel.modules.join("modules.builtin");
        let builtin = std::fs::read_to_string(&builtin_list)
            .with_context(|| format!("reading {}", builtin_list.display()))?
            .lines()
            .filter_map(|l| module_name(Path::new(l)))
            .collect();
        Ok(Self { files, builtin })
    }

    fn visit(
        &self,
        kernel: &Unpacked,
        name: &str,
        seen: &mut HashSet<String>,
        order: &mut Vec<(String, PathBuf)>,
    ) -> Result<()> {
        if self.builtin.contains(name) || !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let file = self.files.get(name).with_context(|| {
            format!(
                "kernel {} has no module {name} (neither a .ko nor built in)",
                kernel.release
            )
        })?;
        let ko = decompressed(kernel, name, file)?;
        let depends = captured(Command::new("modinfo").args(["-F", "depends"]).arg(&ko))?;
        for dependency in depends.trim().split(',').filter(|d| !d.is_empty()) {
            self.visit(kernel, &normalize(dependency), seen, order)?;
        }
        order.push((name.to_owned(), ko));
        Ok(())
    }
}

/// `veth` for `.../veth.ko`, `.ko.xz` or `.ko.zst`.
fn module_name(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let stem = [".ko", ".ko.xz", ".ko.zst"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))?;
    Some(normalize(stem))
}

/// The module as a plain `.ko` (busybox's insmod hands the file to the
/// kernel as it is; 6.12's are xz-compressed), decompressed once.
fn decompressed(kernel: &Unpacked, name: &str, file: &Path) -> Result<PathBuf> {
    let tool = match file.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        _ => return Ok(file.to_owned()),
    };
    let ko = kernel.decompressed.join(format!("{name}.ko"));
    if ko.exists() {
        return Ok(ko);
    }
    std::fs::create_dir_all(&kernel.decompressed)?;
    let partial = ko.with_extension("partial");
    let out = File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    quiet(Command::new(tool).arg("-dc").arg(file).stdout(out))?;
    std::fs::rename(&partial, &ko)?;
    Ok(ko)
}
