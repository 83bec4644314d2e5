//! The proxy's modules in layers, lowest first; a module may import only from its own
//! layer or those below it. The test reads every source file and fails on an import that
//! points up (outside tests), and on an allowed exception that no longer occurs, so the
//! list of exceptions only shrinks.

#![cfg(test)]

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, lowest first, each with the module paths it holds (a path holds its
/// submodules unless one of them is listed itself).
const LAYERS: &[(&str, &[&str])] = &[
    (
        "base",
        &[
            "api_error",
            "auth",
            "clock",
            "edge_metrics",
            "epp::metrics",
            "error",
            "failure",
            "grpc::rpc",
            "headers",
            "limits",
            "metrics",
            "openapi",
            "request_fields",
            "request_id",
            "retry",
            "route",
            "sse",
            "tls",
            "token_timing",
            "usage",
        ],
    ),
    (
        "engines",
        &[
            "adapters",
            "discovery",
            "engine_protocol",
            "health",
            "instance",
            "outlier",
            "pool",
            "pool_builder",
            "registry",
            "upstream",
            "upstream_session",
        ],
    ),
    (
        "state",
        &["health_check", "kv_sweeper", "state", "tokenizer_check"],
    ),
    ("request", &["request"]),
    (
        "frontends",
        &[
            "accept",
            "data_app",
            "epp",
            "grpc",
            "h1",
            "request_body",
            "respond",
        ],
    ),
    (
        "runtime",
        &[
            "admin_app",
            "bench_support",
            "control_plane",
            "layering",
            "lib",
            "main",
            "reload",
            "server",
        ],
    ),
];

/// Imports that point up today, as (importing module, imported module). Remove an entry
/// when the import goes; the test fails while a listed one no longer occurs.
const ALLOWED: &[(&str, &str)] = &[];

/// The layer of `module` (a `::` path) and the listed module that holds it (its longest
/// listed prefix).
fn layer(module: &str) -> Option<(usize, &'static str)> {
    let mut best: Option<(usize, &'static str)> = None;
    for (index, (_, modules)) in LAYERS.iter().enumerate() {
        for listed in *modules {
            let holds = module == *listed
                || module
                    .strip_prefix(listed)
                    .is_some_and(|rest| rest.starts_with("::"));
            if holds && best.is_none_or(|(_, held)| listed.len() > held.len()) {
                best = Some((index, listed));
            }
        }
    }
    best
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

/// The module paths `source` names after `crate::`, outside its test module.
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
        let modules: Vec<&str> = path
            .split("::")
            .take_while(|part| part.starts_with(|c: char| c.is_ascii_lowercase()))
            .collect();
        if !modules.is_empty() {
            found.insert(modules.join("::"));
        }
    }
    found
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
            let top = matches!(module.as_str(), "lib" | "main");
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
fn no_module_imports_from_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut violations = BTreeSet::new();
    let test_only = test_modules(&files);
    for file in &files {
        let module = module_of(file.strip_prefix(&src).expect("under src"));
        if test_only
            .iter()
            .any(|test| module == *test || module.starts_with(&format!("{test}::")))
        {
            continue;
        }
        let Some((own, _)) = layer(&module) else {
            panic!("module {module} is in no layer: add it to LAYERS");
        };
        let source = std::fs::read_to_string(file).expect("read source");
        for imported in imports(&source) {
            let (theirs, listed) = layer(&imported)
                .unwrap_or_else(|| panic!("{module} imports {imported}, which is in no layer"));
            if theirs > own {
                violations.insert((module.clone(), listed.to_string()));
            }
        }
    }
    let allowed: BTreeSet<(String, String)> = ALLOWED
        .iter()
        .map(|(from, to)| (from.to_string(), to.to_string()))
        .collect();
    let new: Vec<_> = violations.difference(&allowed).collect();
    let gone: Vec<_> = allowed.difference(&violations).collect();
    assert!(new.is_empty(), "imports from a layer above: {new:?}");
    assert!(gone.is_empty(), "allowed but no longer imported: {gone:?}");
}

#[test]
fn an_import_from_above_is_found() {
    let source = "use crate::state::State;\nfn f() { crate::server::go(); }\n#[cfg(test)]\nuse crate::data_app::X;";
    let found: Vec<String> = imports(source).into_iter().collect();
    assert_eq!(found, ["server::go", "state"]);
    let layer_of = |module| layer(module).map(|(index, _)| index);
    assert!(layer_of("server::go") > layer_of("state"));
    assert!(layer_of("grpc::rpc::Rpc") < layer_of("grpc::service"));
    assert_eq!(
        layer("grpc::rpc::Rpc").map(|(_, listed)| listed),
        Some("grpc::rpc")
    );
}
