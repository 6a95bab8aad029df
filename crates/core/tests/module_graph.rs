//! The modules of each workspace crate form no circle: every top-level
//! module may name (`crate::m`) only modules that do not name it back,
//! directly or through others. The one exception is the IR and the ops
//! of `stepgraph-core`: a trace's nodes hold an `Op`, and every op
//! describes itself in the IR's types, so the two are one layer on purpose.
//!
//! The graph is read from the sources: `crate::m` paths (and `crate::{a, b}`
//! groups, and `super::m` in a crate's top-level files), outside comments
//! and outside test-only code (`#[cfg(test)]` modules, inline or in files
//! of their own).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Modules allowed to name each other: merged into one node.
const ONE_LAYER: &[(&str, &[&str])] = &[("stepgraph-core", &["ir", "ops"])];

/// The text of a source file without comments and without the inline
/// test module it ends with.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            // `#[cfg(test)] mod name {` (possibly on the next line): the
            // test module runs to the end of the file by convention.
            let rest = t.trim_start_matches("#[cfg(test)]").trim();
            let next = if rest.is_empty() { lines.peek().map(|l| l.trim().to_string()) } else { Some(rest.into()) };
            if next.is_some_and(|n| n.starts_with("mod ") && n.ends_with('{')) {
                break;
            }
        }
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// Names of modules a file declares as test-only (`#[cfg(test)] mod x;`).
fn test_only_children(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    for (i, l) in lines.iter().enumerate() {
        let decl = if l.starts_with("#[cfg(test)]") {
            let rest = l.trim_start_matches("#[cfg(test)]").trim();
            if rest.is_empty() {
                lines.get(i + 1).copied().unwrap_or("")
            } else {
                rest
            }
        } else {
            continue;
        };
        let decl = decl.trim_start_matches("pub(crate) ").trim_start_matches("pub(super) ").trim_start_matches("pub ");
        if let Some(name) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            out.insert(name.trim().to_string());
        }
    }
    out
}

/// Every non-test `.rs` file under `dir` (a module's folder), recursively.
fn module_files(dir: &Path, skip: &BTreeSet<String>, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    // Test-only children declared by this folder's mod.rs.
    let mut skip_here = skip.clone();
    if let Ok(text) = std::fs::read_to_string(dir.join("mod.rs")) {
        skip_here.extend(test_only_children(&text));
    }
    for p in entries {
        let stem = p.file_stem().unwrap().to_string_lossy().to_string();
        if skip_here.contains(&stem) {
            continue;
        }
        if p.is_dir() {
            module_files(&p, &BTreeSet::new(), out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            // A file's own test-only children (`foo.rs` declaring `mod tests;` in `foo/`).
            out.push(p);
        }
    }
}

/// The top-level modules a piece of code names.
fn named_modules(code: &str, top_level_file: bool, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut prefixes = vec!["crate::"];
    if top_level_file {
        prefixes.push("super::");
    }
    for prefix in prefixes {
        for (i, _) in code.match_indices(prefix) {
            // Not part of a longer path such as `stepgraph_core::`.
            if code[..i].chars().last().is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &code[i + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `crate::{a::X, b, c::{..}}`: the first name of each top-level item.
                let mut depth = 0;
                let mut item_start = true;
                for (j, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => item_start = true,
                        c if item_start && !c.is_whitespace() => {
                            out.insert(ident(&group[j..]));
                            item_start = false;
                        }
                        _ => {}
                    }
                }
            } else {
                out.insert(ident(rest));
            }
        }
    }
    out.retain(|m| modules.contains(m));
    out
}

/// The crate's module graph: top-level module -> modules it names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let root_file = if src.join("lib.rs").exists() { src.join("lib.rs") } else { src.join("main.rs") };
    let root = std::fs::read_to_string(&root_file).unwrap();
    let skip = test_only_children(&root);
    let mut modules = BTreeSet::new();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let stem = p.file_stem().unwrap().to_string_lossy().to_string();
        if stem == "lib"
            || stem == "main"
            || skip.contains(&stem)
            || (p.is_file() && p.extension().is_none_or(|x| x != "rs"))
        {
            continue;
        }
        modules.insert(stem);
    }
    let mut edges = BTreeMap::new();
    for m in &modules {
        let mut files = Vec::new();
        let file = src.join(format!("{m}.rs"));
        let mut top_files = BTreeSet::new();
        if file.exists() {
            files.push(file.clone());
            top_files.insert(file.clone());
            let dir = src.join(m);
            if dir.is_dir() {
                let text = std::fs::read_to_string(&file).unwrap();
                module_files(&dir, &test_only_children(&text), &mut files);
            }
        } else {
            let dir = src.join(m);
            top_files.insert(dir.join("mod.rs"));
            module_files(&dir, &BTreeSet::new(), &mut files);
        }
        let mut named = BTreeSet::new();
        for f in &files {
            let code = code_of(&std::fs::read_to_string(f).unwrap());
            named.extend(named_modules(&code, top_files.contains(f), &modules));
        }
        named.remove(m);
        edges.insert(m.clone(), named);
    }
    edges
}

/// The circles of `edges` (strongly connected sets of more than one module).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Reachability by repeated search: the graphs are small.
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for n in &edges[&m] {
                if seen.insert(n.clone()) {
                    todo.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = edges.keys().map(|m| (m, reach(m))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for m in edges.keys() {
        if done.contains(m) {
            continue;
        }
        let set: Vec<String> =
            edges.keys().filter(|n| *n == m || (reaches[m].contains(*n) && reaches[*n].contains(m))).cloned().collect();
        done.extend(set.iter().cloned());
        if set.len() > 1 {
            out.push(set);
        }
    }
    out
}

#[test]
fn no_crate_has_a_circle_between_its_modules() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(crates).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    for dir in dirs {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let name = manifest.lines().find_map(|l| l.strip_prefix("name = ")).unwrap().trim_matches('"').to_string();
        let mut edges = graph(&dir.join("src"));
        // Merge the modules that form one layer on purpose.
        for (krate, layer) in ONE_LAYER {
            if *krate != name {
                continue;
            }
            let merged = layer.join("+");
            let mut out = BTreeSet::new();
            for m in *layer {
                out.extend(edges.remove(*m).unwrap_or_default());
            }
            for targets in edges.values_mut() {
                // Every member removed (no short-circuit), then the layer named once.
                if layer.iter().map(|m| targets.remove(*m)).fold(false, |a, b| a | b) {
                    targets.insert(merged.clone());
                }
            }
            out.retain(|t| !layer.contains(&t.as_str()));
            edges.insert(merged, out);
        }
        for set in circles(&edges) {
            let links: Vec<String> = set
                .iter()
                .flat_map(|a| edges[a].iter().filter(|b| set.contains(b)).map(move |b| format!("{a} -> {b}")))
                .collect();
            found.push(format!("{name}: {}", links.join(", ")));
        }
    }
    assert!(found.is_empty(), "modules that name each other:\n{}", found.join("\n"));
}

#[test]
fn the_reader_finds_paths_and_groups_outside_comments_and_tests() {
    let modules: BTreeSet<String> = ["a", "b", "c", "d"].map(String::from).into();
    let code = code_of(
        "use crate::a::X;\nuse crate::{b::Y, c};\n// crate::d in a comment\nfn f() { stepgraph_core::d::z(); }\n#[cfg(test)]\nmod tests {\n    use crate::d;\n}\n",
    );
    assert_eq!(named_modules(&code, false, &modules), ["a", "b", "c"].map(String::from).into());
    assert_eq!(test_only_children("#[cfg(test)]\nmod host_model;\npub mod x;\n"), ["host_model".to_string()].into());
}
