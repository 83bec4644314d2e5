//! The proxy's layers are the directories of `src/`, lowest first; a file may import only
//! from its own directory and those below it. The spine is `request.rs` with `request/`;
//! `lib.rs` and `main.rs` are the top, above every layer. The test reads every source file
//! and fails on an import that points up (outside tests), including one through the crate
//! root's re-exports (`crate::Proxy`), which belong to the top.

#![cfg(test)]

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, lowest first: the directories of `src/` (the spine, `request`, is
/// `request.rs` and `request/`).
const LAYERS: &[&str] = &[
    "openai", "edge", "metrics", "engines", "state", "request", "frontend", "runtime",
];

/// The files at the top of `src/`, above every layer.
const TOP: &[&str] = &["lib", "main"];

/// The layer of a module path: the index in [`LAYERS`] of its first segment, or `None`
/// for what is not a layer (the crate root and its re-exports: the top).
fn layer(module: &str) -> Option<usize> {
    let top = module.split("::").next().unwrap_or(module);
    LAYERS.iter().position(|layer| *layer == top)
}

/// The module path of a source file (`src/a/b.rs` and `src/a/b/mod.rs`: `a::b`).
fn module_of(relative: &Path) -> String {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.last_mut() {
        *last = last.trim_end_matches(".rs").to_string();
    }
    if parts.last().is_some_and(|last| last == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// The paths `source` names after `crate::`, outside its test module, up to the first
/// segment that is not a module (`crate::Proxy`, a re-export of the crate root: `Proxy`).
fn imports(source: &str) -> BTreeSet<String> {
    let before_tests = source.split("#[cfg(test)]").next().unwrap_or(source);
    let code: String = before_tests
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let path: String = code[at + "crate::".len()..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let mut parts = path.split("::").filter(|part| !part.is_empty());
        let Some(first) = parts.next() else {
            continue;
        };
        let mut modules = vec![first];
        modules.extend(parts.take_while(|part| part.starts_with(|c: char| c.is_ascii_lowercase())));
        found.insert(modules.join("::"));
    }
    found
}

/// The upward imports of the file at `relative` (under `src/`) with `source`, as
/// (its module, the path it imports); a file at the top may import anything.
fn upward(relative: &Path, source: &str) -> Vec<(String, String)> {
    let module = module_of(relative);
    if TOP.contains(&module.as_str()) {
        return Vec::new();
    }
    let Some(own) = layer(&module) else {
        panic!(
            "{} is in no layer: src/ holds only {TOP:?}, request.rs and the directories {LAYERS:?}",
            relative.display()
        );
    };
    imports(source)
        .into_iter()
        .filter(|imported| layer(imported).is_none_or(|theirs| theirs > own))
        .map(|imported| (module.clone(), imported))
        .collect()
}

/// The modules declared under `#[cfg(test)]` (`#[cfg(test)] mod fuzz;` in `a/mod.rs`:
/// `a::fuzz`).
fn test_modules(files: &[std::path::PathBuf]) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in files {
        let relative = file.strip_prefix(&src).expect("under src");
        let module = module_of(relative);
        let source = std::fs::read_to_string(file).expect("read source");
        let mut lines = source.lines();
        while let Some(line) = lines.next() {
            if line.trim() != "#[cfg(test)]" {
                continue;
            }
            let Some(name) = lines.next().and_then(|next| {
                next.trim()
                    .trim_start_matches("pub(crate) ")
                    .strip_prefix("mod ")?
                    .strip_suffix(';')
            }) else {
                continue;
            };
            // `lib.rs` and `main.rs` declare top-level modules.
            let top = TOP.contains(&module.as_str());
            found.push(if top {
                name.to_string()
            } else {
                format!("{module}::{name}")
            });
        }
    }
    found
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn src_holds_only_the_top_the_spine_and_the_layer_directories() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(&src).expect("read src") {
        let path = entry.expect("dir entry").path();
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let allowed = if path.is_dir() {
            LAYERS.contains(&name.as_str())
        } else {
            name == "request.rs" || TOP.iter().any(|top| name == format!("{top}.rs"))
        };
        assert!(
            allowed,
            "src/{name} is neither a layer directory {LAYERS:?} nor {TOP:?} nor request.rs"
        );
        if path.is_dir() {
            found.insert(name);
        }
    }
    let listed: BTreeSet<String> = LAYERS.iter().map(|layer| layer.to_string()).collect();
    assert_eq!(found, listed, "every layer is a directory of src/");
}

#[test]
fn no_module_imports_from_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut violations = BTreeSet::new();
    let test_only = test_modules(&files);
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let module = module_of(relative);
        if test_only
            .iter()
            .any(|test| module == *test || module.starts_with(&format!("{test}::")))
        {
            continue;
        }
        let source = std::fs::read_to_string(file).expect("read source");
        violations.extend(upward(relative, &source));
    }
    assert!(
        violations.is_empty(),
        "imports from a layer above: {violations:?}"
    );
}

#[test]
fn an_import_from_above_is_found() {
    let source = "use crate::openai::sse::Scanner;\nfn f() { crate::state::shared::go(); }\n#[cfg(test)]\nuse crate::frontend::data_app::X;";
    let found: Vec<String> = imports(source).into_iter().collect();
    assert_eq!(found, ["openai::sse", "state::shared::go"]);
    assert!(layer("state::shared::go") > layer("openai::sse"));
    let from = |file: &str, source: &str| upward(Path::new(file), source);
    assert_eq!(
        from("engines/pool.rs", source),
        [("engines::pool".to_string(), "state::shared::go".to_string())]
    );
    assert_eq!(from("frontend/grpc/infer.rs", source), []);
    // The spine is `request.rs` and `request/`: below the front ends, above the state.
    assert_eq!(from("request.rs", source), []);
    assert_eq!(
        from("request/pick.rs", "use crate::frontend::h1::io;").len(),
        1
    );
    // A re-export of the crate root is the top's, above every layer.
    assert_eq!(
        from("frontend/grpc/server.rs", "use crate::ProxyError;"),
        [(
            "frontend::grpc::server".to_string(),
            "ProxyError".to_string()
        )]
    );
    assert_eq!(from("lib.rs", "use crate::runtime::server::Proxy;"), []);
}
