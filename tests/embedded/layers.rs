//! The layers of the two crates, read from their source: which top-level module of `src/` and
//! `core/src/` each file imports (`use crate::x`, `crate::x::` and `sluice_core::x::` paths,
//! `super::` paths that leave their top-level module), no import circle among them, a pure
//! limiter, which the stores and the service build on, and a core crate with no server in its
//! dependencies.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What the limiter sits below or beside: it imports none of them.
const NOT_FOR_THE_LIMITER: [&str; 7] = [
    "store",
    "service",
    "telemetry",
    "quota",
    "rules",
    "config",
    "settings",
];

/// One module's import of another top-level module, and where it is.
#[derive(Clone, Debug)]
struct Import {
    from: String,
    to: String,
    file: String,
    line: usize,
}

impl std::fmt::Display for Import {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} → {} ({}:{})",
            self.from, self.to, self.file, self.line
        )
    }
}

/// A token of Rust source, comments and literals left out.
#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// The tokens of `source` that paths are made of: identifiers, `::` and punctuation. Comments,
/// strings and characters are skipped, so that neither docs nor messages count as imports.
fn tokens(source: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = source.chars().collect();
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < chars.len() {
        match chars[i] {
            '\n' => {
                line += 1;
                i += 1;
            }
            '/' if at(i + 1) == '/' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if at(i + 1) == '*' => {
                let mut depth = 0;
                while i < chars.len() {
                    match (at(i), at(i + 1)) {
                        ('/', '*') => (depth, i) = (depth + 1, i + 2),
                        ('*', '/') if depth == 1 => {
                            i += 2;
                            break;
                        }
                        ('*', '/') => (depth, i) = (depth - 1, i + 2),
                        (c, _) => {
                            line += usize::from(c == '\n');
                            i += 1;
                        }
                    }
                }
            }
            '"' => i = skip_string(&chars, i, None, &mut line),
            // A character ('x', '\n', '\u{7f}') or a lifetime ('a).
            '\'' if at(i + 1) == '\\' => {
                i += 2;
                while !matches!(at(i), '\'' | '\0') {
                    i += 1;
                }
                i += 1;
            }
            '\'' if at(i + 2) == '\'' => i += 3,
            ':' if at(i + 1) == ':' => {
                out.push((Token::Path, line));
                i += 2;
            }
            c if c.is_alphabetic() || c == '_' => {
                let start = i;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
                let raw = matches!(word.as_str(), "r" | "br" | "cr");
                if (raw || matches!(word.as_str(), "b" | "c")) && at(i + hashes) == '"' {
                    // A string with a prefix: b"…", c"…", r"…", r#"…"#, br"…".
                    let raw = raw.then_some(hashes);
                    i = skip_string(&chars, i + hashes, raw, &mut line);
                } else if word != "b" || at(i) != '\'' {
                    out.push((Token::Ident(word), line));
                }
            }
            c if c.is_whitespace() || c.is_ascii_digit() => i += 1,
            c => {
                out.push((Token::Punct(c), line));
                i += 1;
            }
        }
    }
    out
}

/// The index after the string whose opening quote is at `open`: a raw one (`Some` of its
/// hashes) ends at a quote and as many hashes and has no escapes.
fn skip_string(chars: &[char], open: usize, raw: Option<usize>, line: &mut usize) -> usize {
    let mut i = open + 1;
    while i < chars.len() {
        match (chars[i], raw) {
            ('\\', None) => i += 2,
            ('"', None) => return i + 1,
            ('"', Some(hashes))
                if chars[i + 1..]
                    .iter()
                    .take(hashes)
                    .filter(|&&c| c == '#')
                    .count()
                    == hashes =>
            {
                return i + 1 + hashes;
            }
            (c, _) => {
                *line += usize::from(c == '\n');
                i += 1;
            }
        }
    }
    i
}

/// The module a file of a `src/` holds: `core/src/store/redis/mod.rs` → `["store", "redis"]`.
fn module_of(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let file = parts.pop().expect("a file name");
    match file.as_str() {
        "mod.rs" | "lib.rs" => {}
        other => parts.push(other.trim_end_matches(".rs").to_owned()),
    }
    parts
}

/// The top-level modules named right after a path's prefix at `i`: one name, or each item of a
/// `{…}` group.
fn names_at(tokens: &[(Token, usize)], i: usize) -> Vec<String> {
    match tokens.get(i) {
        Some((Token::Ident(name), _)) => vec![name.clone()],
        Some((Token::Punct('{'), _)) => {
            let (mut depth, mut names, mut first) = (0, Vec::new(), true);
            for (token, _) in &tokens[i..] {
                match token {
                    Token::Punct('{') => depth += 1,
                    Token::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Token::Punct(',') if depth == 1 => first = true,
                    Token::Ident(name) if depth == 1 && first => {
                        names.push(name.clone());
                        first = false;
                    }
                    _ => {}
                }
            }
            names
        }
        _ => Vec::new(),
    }
}

/// Where a walk over a file's tokens is: its brace depth, and the depths at which the inline
/// modules it is in (`mod tests { … }`) close.
#[derive(Default)]
struct Nesting {
    depth: usize,
    inline: Vec<usize>,
}

impl Nesting {
    /// Follows the token at `i`.
    fn step(&mut self, tokens: &[(Token, usize)], i: usize) {
        match &tokens[i].0 {
            Token::Punct('{') => self.depth += 1,
            Token::Punct('}') => {
                if self.inline.last() == Some(&self.depth) {
                    self.inline.pop();
                }
                self.depth = self.depth.saturating_sub(1);
            }
            Token::Ident(w)
                if w == "mod" && matches!(tokens.get(i + 2), Some((Token::Punct('{'), _))) =>
            {
                self.inline.push(self.depth + 1);
            }
            _ => {}
        }
    }
}

/// Every import, by the file of module `module` (its top-level module first), of a top-level
/// module among `tops` other than its own.
fn imports(file: &str, module: &[String], source: &str, tops: &BTreeSet<String>) -> Vec<Import> {
    let tokens = tokens(source);
    let ident =
        |i: usize, word: &str| matches!(tokens.get(i), Some((Token::Ident(w), _)) if w == word);
    let path_at = |i: usize| matches!(tokens.get(i), Some((Token::Path, _)));
    let mut found = Vec::new();
    let mut nesting = Nesting::default();
    for (i, (token, line)) in tokens.iter().enumerate() {
        nesting.step(&tokens, i);
        let mut targets = Vec::new();
        match token {
            Token::Ident(word) if (word == "crate" || word == "sluice_core") && path_at(i + 1) => {
                targets = names_at(&tokens, i + 2);
            }
            // The first `super` of a path: it leaves the top-level module when it climbs as
            // many levels as the module is deep.
            Token::Ident(word) if word == "super" && (i == 0 || !path_at(i - 1)) => {
                let mut j = i;
                while ident(j, "super") && path_at(j + 1) {
                    j += 2;
                }
                if (j - i) / 2 == module.len() + nesting.inline.len() {
                    targets = names_at(&tokens, j);
                }
            }
            _ => {}
        }
        for to in targets {
            if tops.contains(&to) && module[0] != to {
                found.push(Import {
                    from: module[0].clone(),
                    to,
                    file: file.to_owned(),
                    line: *line,
                });
            }
        }
    }
    found
}

/// The Rust sources under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every import among the top-level modules of both crates: the server's `src/` (which names the
/// core's modules by their crate, `sluice_core::store`; the binary, `main.rs`, is a crate of its
/// own above it) and the core's `core/src/`.
fn crate_imports() -> Vec<Import> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut modules: Vec<(PathBuf, Vec<String>)> = Vec::new();
    for src in [root.join("src"), root.join("core/src")] {
        let mut files = Vec::new();
        sources(&src, &mut files);
        files.sort();
        files.retain(|f| {
            f != &src.join("main.rs") && f != &src.join("lib.rs") && !f.starts_with(src.join("bin"))
        });
        modules.extend(files.into_iter().map(|f| {
            let module = module_of(f.strip_prefix(&src).expect("under its src/"));
            (f, module)
        }));
    }
    let tops: BTreeSet<String> = modules
        .iter()
        .filter_map(|(_, m)| m.first().cloned())
        .collect();
    let mut all = Vec::new();
    for (file, module) in &modules {
        let source = std::fs::read_to_string(file).expect("a readable source file");
        let name = file
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .expect("in the crate")
            .display()
            .to_string();
        all.extend(imports(&name, module, &source, &tops));
    }
    all
}

/// The first import of each (from, to) pair of modules.
fn graph(imports: &[Import]) -> BTreeMap<String, BTreeMap<String, Import>> {
    let mut graph: BTreeMap<String, BTreeMap<String, Import>> = BTreeMap::new();
    for import in imports {
        graph
            .entry(import.from.clone())
            .or_default()
            .entry(import.to.clone())
            .or_insert_with(|| import.clone());
    }
    graph
}

/// The import circles of `graph`: for each module on one (in name order), the shortest way back
/// to it, unless an earlier circle already holds it.
fn circles(graph: &BTreeMap<String, BTreeMap<String, Import>>) -> Vec<Vec<Import>> {
    let mut found: Vec<Vec<Import>> = Vec::new();
    for start in graph.keys() {
        if found.iter().flatten().any(|i| &i.from == start) {
            continue;
        }
        // Breadth first, remembering how each module was reached.
        let mut reached: BTreeMap<&String, &Import> = BTreeMap::new();
        let mut frontier = vec![start];
        let mut back = None;
        while back.is_none() && !frontier.is_empty() {
            let mut next = Vec::new();
            for from in frontier {
                for (to, import) in graph.get(from).into_iter().flatten() {
                    if to == start {
                        back = Some(import);
                        break;
                    }
                    if !reached.contains_key(to) {
                        reached.insert(to, import);
                        next.push(to);
                    }
                }
                if back.is_some() {
                    break;
                }
            }
            frontier = next;
        }
        if let Some(last) = back {
            let mut circle = vec![last.clone()];
            while &circle[0].from != start {
                circle.insert(0, reached[&circle[0].from].clone());
            }
            found.push(circle);
        }
    }
    found
}

#[test]
fn no_import_circle_among_the_top_level_modules() {
    let graph = graph(&crate_imports());
    let found = circles(&graph);
    let report: Vec<String> = found
        .iter()
        .map(|circle| {
            let path: Vec<&str> = circle.iter().map(|i| i.from.as_str()).collect();
            let edges: Vec<String> = circle.iter().map(|i| format!("  {i}")).collect();
            format!(
                "{} → {}\n{}",
                path.join(" → "),
                circle[0].from,
                edges.join("\n")
            )
        })
        .collect();
    assert!(
        report.is_empty(),
        "import circles among the modules (a lower module must not import a higher one):\n{}",
        report.join("\n")
    );
}

/// The path named at `i`, up to its first `{` group or its end: `a::b::C` → `[a, b, C]`; a group
/// gives each of its items' first names after the path before it.
fn paths_at(tokens: &[(Token, usize)], i: usize) -> Vec<Vec<String>> {
    let mut path = Vec::new();
    let mut j = i;
    while let Some((Token::Ident(name), _)) = tokens.get(j) {
        path.push(name.clone());
        if !matches!(tokens.get(j + 1), Some((Token::Path, _))) {
            return vec![path];
        }
        j += 2;
    }
    let group = names_at(tokens, j);
    if group.is_empty() {
        return vec![path];
    }
    group
        .into_iter()
        .map(|name| path.iter().cloned().chain([name]).collect())
        .collect()
}

/// Every import of one file by another of the same crate (`crate::`, `super::`, `self::` and,
/// from the server, `sluice_core::` paths, outside inline modules such as `mod tests`), as the
/// files that hold the modules named; a module and the modules inside it (a parent declares
/// them, a child reaches its parent's items) are one unit here.
fn file_imports() -> Vec<Import> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // (crate, module path) → the file that holds it.
    let mut files: BTreeMap<(usize, Vec<String>), String> = BTreeMap::new();
    for (c, src) in [root.join("src"), root.join("core/src")].iter().enumerate() {
        let mut found = Vec::new();
        sources(src, &mut found);
        for f in found {
            if f == src.join("main.rs") || f.starts_with(src.join("bin")) {
                continue;
            }
            let module = module_of(f.strip_prefix(src).expect("under its src/"));
            let name = f
                .strip_prefix(root)
                .expect("in the crate")
                .display()
                .to_string();
            files.insert((c, module), name);
        }
    }
    let mut all = Vec::new();
    for ((c, module), file) in &files {
        let source = std::fs::read_to_string(root.join(file)).expect("a readable source file");
        let tokens = tokens(&source);
        let path_at = |i: usize| matches!(tokens.get(i), Some((Token::Path, _)));
        let word = |i: usize| match tokens.get(i) {
            Some((Token::Ident(w), _)) => Some(w.as_str()),
            _ => None,
        };
        let mut nesting = Nesting::default();
        for (i, (_, line)) in tokens.iter().enumerate() {
            nesting.step(&tokens, i);
            if !nesting.inline.is_empty() || (i > 0 && path_at(i - 1)) || !path_at(i + 1) {
                continue;
            }
            // Where the path starts: its crate and module.
            let (target_crate, base, j) = match word(i) {
                Some("crate") => (*c, Vec::new(), i + 2),
                Some("sluice_core") if *c == 0 => (1, Vec::new(), i + 2),
                Some("self") => (*c, module.clone(), i + 2),
                Some("super") => {
                    let mut base = module.clone();
                    let mut j = i;
                    while word(j) == Some("super") && path_at(j + 1) {
                        base.pop();
                        j += 2;
                    }
                    (*c, base, j)
                }
                _ => continue,
            };
            for path in paths_at(&tokens, j) {
                let mut to = base.clone();
                let mut held_by = files.get(&(target_crate, base.clone())).cloned();
                for name in path {
                    to.push(name);
                    match files.get(&(target_crate, to.clone())) {
                        Some(f) => held_by = Some(f.clone()),
                        None => break,
                    }
                }
                let to: Vec<String> = files
                    .iter()
                    .find(|(_, f)| Some(*f) == held_by.as_ref())
                    .map(|((_, m), _)| m.clone())
                    .unwrap_or_default();
                let Some(target) = held_by else { continue };
                let nested =
                    target_crate == *c && (to.starts_with(module) || module.starts_with(&to));
                if !nested {
                    all.push(Import {
                        from: file.clone(),
                        to: target,
                        file: file.clone(),
                        line: *line,
                    });
                }
            }
        }
    }
    all
}

/// No two files import each other, however far round: a circle of files is a circle of
/// concepts, which the next change has to understand together.
#[test]
fn no_import_circle_among_the_files() {
    let found = circles(&graph(&file_imports()));
    let report: Vec<String> = found
        .iter()
        .map(|circle| {
            let edges: Vec<String> = circle
                .iter()
                .map(|i| format!("  {} (line {})", i.to, i.line))
                .collect();
            format!("{}:\n{}", circle[0].from, edges.join("\n"))
        })
        .collect();
    assert!(
        report.is_empty(),
        "import circles among the files (each file, then the files it imports round to it):\n{}",
        report.join("\n")
    );
}

#[test]
fn the_limiter_imports_nothing_above_or_beside_it() {
    let wrong: Vec<String> = crate_imports()
        .into_iter()
        .filter(|i| i.from == "limiter" && NOT_FOR_THE_LIMITER.contains(&i.to.as_str()))
        .map(|i| format!("  {i}"))
        .collect();
    assert!(
        wrong.is_empty(),
        "the limiter is pure (limits, algorithms, counter identities, Check → Decision, the \
         cache's rules); it imports:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_imports_read_are_those_the_layers_have() {
    let graph = graph(&crate_imports());
    let imported = |from: &str, to: &str| graph.get(from).is_some_and(|m| m.contains_key(to));
    assert!(imported("service", "rules"), "{graph:#?}");
    assert!(imported("service", "store"));
    assert!(imported("rules", "limiter"));
    assert!(imported("store", "limiter"));
}

#[test]
fn every_form_of_a_path_is_read_and_nothing_else() {
    let tops: BTreeSet<String> = ["a", "b", "c", "d", "e", "f"].map(String::from).into();
    let source = r###"
        //! Mentions crate::f in a comment.
        use crate::a::Thing;
        use crate::{b::Other, c};
        pub(crate) fn f() -> &'static str { let _ = crate::d::run(); "crate::f::x" }
        /* crate::f /* nested */ crate::f */
        const RAW: &str = r#"crate::f "quoted" "#;
        const BYTE: u8 = b'"';
        const CHAR: char = '"';
        mod tests {
            use super::*;
            use super::super::super::e::Inner;
        }
        use sluice_core::f::Core;
    "###;
    let module = ["x".to_owned(), "y".to_owned()];
    let found: Vec<(String, usize)> = imports("src/x/y.rs", &module, source, &tops)
        .into_iter()
        .map(|i| (i.to, i.line))
        .collect();
    let expected: Vec<(String, usize)> =
        [("a", 3), ("b", 4), ("c", 4), ("d", 5), ("e", 12), ("f", 14)]
            .map(|(m, l)| (m.to_owned(), l))
            .into();
    assert_eq!(found, expected);
    let at_top = imports("src/x/mod.rs", &module[..1], "use super::f::Y;", &tops);
    assert_eq!(
        at_top.len(),
        1,
        "super:: of a top-level module is the crate"
    );
}

/// The crate map of docs/architecture.md ("may import") holds for the code: every import of a
/// top-level module is one its row allows, every module that imports another has a row, and no
/// module imports `settings` (only `main.rs` does).
#[test]
fn the_crate_map_in_the_docs_matches_the_imports() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .expect("docs/architecture.md");
    let mut allowed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for row in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let Some(module) = cells[0]
            .strip_prefix("| `")
            .and_then(|c| c.strip_suffix('`'))
        else {
            continue;
        };
        let may: BTreeSet<String> = cells
            .last()
            .expect("a row's cells")
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|name| !name.ends_with(".rs"))
            .map(String::from)
            .collect();
        allowed.insert(module.to_owned(), may);
    }
    let mut wrong = Vec::new();
    for (from, imported) in graph(&crate_imports()) {
        let Some(may) = allowed.get(&from) else {
            wrong.push(format!("  {from}: no row in the crate map"));
            continue;
        };
        for (to, import) in imported {
            if !may.contains(&to) {
                let may: Vec<&str> = may.iter().map(String::as_str).collect();
                wrong.push(format!("  {import} (the map allows {})", may.join(", ")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports the crate map in docs/architecture.md does not allow:\n{}",
        wrong.join("\n")
    );
    assert!(allowed.contains_key("limiter") && allowed["limiter"].is_empty());
}

/// The statics `source` declares outside any function, block or inline module.
fn statics_in(source: &str) -> BTreeSet<String> {
    let tokens = tokens(source);
    let mut statics = BTreeSet::new();
    let mut depth = 0usize;
    for (i, (token, _)) in tokens.iter().enumerate() {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => depth = depth.saturating_sub(1),
            Token::Ident(word) if word == "static" && depth == 0 => {
                if let (Some((Token::Ident(name), _)), Some((Token::Punct(':'), _))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                {
                    statics.insert(name.clone());
                }
            }
            _ => {}
        }
    }
    statics
}

/// The statics declared at the top of a module under `dir`, each as `file: static NAME`.
fn statics_under(dir: &str) -> Vec<String> {
    let mut files = Vec::new();
    sources(Path::new(dir), &mut files);
    files
        .iter()
        .flat_map(|file| {
            let source = std::fs::read_to_string(file).expect("a source file");
            statics_in(&source)
                .into_iter()
                .map(move |name| format!("{}: static {name}", file.display()))
        })
        .collect()
}

#[test]
fn telemetry_keeps_no_state_in_statics() {
    let found = statics_under("src/telemetry");
    assert!(
        found.is_empty(),
        "telemetry's state lives in the Telemetry handle, which is handed to what tells it:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_limiter_holds_no_process_global() {
    let found = statics_under("core/src/limiter");
    assert!(
        found.is_empty(),
        "the limiter's state lives in what it is handed (a calendar's clock offset is a field of \
         the calendar):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_static_is_found_at_the_top_of_a_module_and_nowhere_else() {
    let found = statics_in(
        "static ON: AtomicBool = AtomicBool::new(false);\n\
         pub static TOP: OnceLock<Top> = OnceLock::new();\n\
         fn f(x: &'static str) { static FAILED: LogThrottle = LogThrottle::new(); }\n\
         mod tests { static LOCAL: u8 = 0; }",
    );
    assert_eq!(found, BTreeSet::from(["ON".to_owned(), "TOP".to_owned()]));
}

/// The modules of the core crate, `sluice-core`, which a library embedding sluice's limits
/// would take (the limits and algorithms, the rules, the rule files, the stores, what they tell
/// and PEM files): they cannot import the server's, which is not among its dependencies.
const CORE: [&str; 7] = [
    "limiter",
    "rules",
    "config",
    "store",
    "observe",
    "log_throttle",
    "certs",
];
/// What a server is made of, which the core crate must not depend on: gRPC, HTTP, the command
/// line, metrics, trace export, Envoy's protobuf types, and the server crate itself.
const SERVER_CRATES: [&str; 16] = [
    "sluice",
    "tonic",
    "tonic-health",
    "tonic-reflection",
    "tonic-prost",
    "axum",
    "hyper",
    "hyper-util",
    "clap",
    "envoy-types",
    "prost-reflect",
    "prometheus-client",
    "tracing-subscriber",
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry-otlp",
];

/// The names in a manifest's `[dependencies]`.
fn dependencies(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut inside = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == "[dependencies]";
        } else if inside && !line.is_empty() && !line.starts_with('#') {
            let name = line.split('=').next().expect("a name").trim();
            names.push(name.to_owned());
        }
    }
    names
}

#[test]
fn the_core_crate_holds_the_core_modules_and_depends_on_no_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for module in CORE {
        let core = root.join("core/src").join(module);
        assert!(
            core.is_dir() || core.with_extension("rs").is_file(),
            "{module} lives in core/src/"
        );
        let server = root.join("src").join(module);
        assert!(
            !server.exists() && !server.with_extension("rs").exists(),
            "{module} is the core's, not the server's"
        );
    }
    let manifest = std::fs::read_to_string(root.join("core/Cargo.toml")).expect("core/Cargo.toml");
    let names = dependencies(&manifest);
    assert!(names.contains(&"fred".to_owned()), "read: {names:?}");
    let wrong: Vec<&String> = names
        .iter()
        .filter(|n| SERVER_CRATES.contains(&n.as_str()))
        .collect();
    assert!(
        wrong.is_empty(),
        "sluice-core depends on what makes a server: {wrong:?}"
    );
}

/// The most lines a file of `src/service/` holds: one concept a file, each readable whole.
const MOST_SERVICE_LINES: usize = 700;

/// The server names the core's modules by their crate: no `pub use` gives them the server's
/// names, so that a path says which crate it is in.
#[test]
fn the_server_re_exports_nothing_of_the_core() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    let mut found = Vec::new();
    for file in files {
        let source = std::fs::read_to_string(&file).expect("a readable source file");
        for (n, line) in source.lines().enumerate() {
            let line = line.trim_start();
            if line.starts_with("pub use sluice_core")
                || line.starts_with("pub(crate) use sluice_core")
            {
                found.push(format!("{}:{}: {line}", file.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the core re-exported:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_file_of_the_service_is_over_700_lines() {
    let mut files = Vec::new();
    sources(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/service"),
        &mut files,
    );
    assert!(files.len() > 10, "read: {files:?}");
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f)
                .expect("readable")
                .lines()
                .count();
            (lines > MOST_SERVICE_LINES).then(|| format!("{}: {lines} lines", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "over {MOST_SERVICE_LINES} lines: {long:?}");
}
