//! The documentation's relative links: every `[text](path)`, `[text](path#anchor)`,
//! `[text](#anchor)` and reference definition `[label]: path` in README.md,
//! BENCHMARKS.md, CHANGELOG.md and docs/**/*.md names a file that exists, and
//! every anchor a heading of that file, slugged as GitHub does. External links
//! (anything with a scheme: http, https, mailto) are not followed.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Component, Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repository")
        .to_path_buf()
}

/// The Markdown files the test reads, relative to the repository root.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = ["README.md", "BENCHMARKS.md", "CHANGELOG.md"]
        .iter()
        .map(PathBuf::from)
        .filter(|f| root.join(f).is_file())
        .collect();
    let mut dirs = vec![PathBuf::from("docs")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(root.join(&dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = dir.join(entry.file_name());
            if root.join(&path).is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// One line of a document with its code spans blanked out, or `None` inside a
/// fenced code block (whose brackets and `#` lines are not Markdown).
fn prose_lines(text: &str) -> Vec<Option<String>> {
    let mut fence: Option<String> = None;
    text.lines()
        .map(|line| {
            let trimmed = line.trim_start();
            let marker: String = trimmed
                .chars()
                .take_while(|&c| c == '`' || c == '~')
                .collect();
            match &fence {
                Some(open) => {
                    if marker.len() >= open.len() && marker.starts_with(&open[..1]) {
                        fence = None;
                    }
                    None
                }
                None if marker.len() >= 3
                    && (marker.chars().all(|c| c == '`') || marker.chars().all(|c| c == '~')) =>
                {
                    fence = Some(marker);
                    None
                }
                None => Some(blank_code_spans(line)),
            }
        })
        .collect()
}

/// `a `[x](y)` b` -> `a        b`: what a code span holds is never a link.
fn blank_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|&&c| c == '`').count();
        // The closing run of the same length, if any.
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let len = chars[j..].iter().take_while(|&&c| c == '`').count();
                if len == run {
                    close = Some(j);
                    break;
                }
                j += len;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                out.push_str("code");
                i = end + run;
            }
            None => {
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// The heading text a line holds (ATX `# Title`), if it is one.
fn atx_heading(line: &str) -> Option<&str> {
    let trimmed = line.trim_start();
    if line.len() - trimmed.len() > 3 {
        return None;
    }
    let hashes = trimmed.chars().take_while(|&c| c == '#').count();
    if !(1..=6).contains(&hashes) {
        return None;
    }
    let rest = &trimmed[hashes..];
    if !rest.is_empty() && !rest.starts_with([' ', '\t']) {
        return None;
    }
    // An optional closing sequence of `#`s.
    let rest = rest.trim();
    let stripped = rest.trim_end_matches('#');
    Some(if stripped.is_empty() || stripped.ends_with(' ') {
        stripped.trim_end()
    } else {
        rest
    })
}

/// The text GitHub renders for a heading's source: links become their text,
/// code spans their content, and emphasis and HTML tags disappear.
fn rendered_text(source: &str) -> String {
    let mut text = String::new();
    let mut chars = source.chars().peekable();
    let mut in_tag = false;
    while let Some(c) = chars.next() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if in_tag => {}
            '`' | '*' | '[' => {}
            ']' if chars.peek() == Some(&'(') => {
                // Skip the link's target.
                let mut depth = 0;
                for c in chars.by_ref() {
                    match c {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                }
            }
            ']' => {}
            _ => text.push(c),
        }
    }
    text
}

/// GitHub's anchor for a heading: lower case, letters, digits, `-` and `_`
/// kept, spaces made `-`, everything else dropped.
fn slug(heading: &str) -> String {
    rendered_text(heading)
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor of a document: its headings' slugs, the second of a name
/// getting `-1`, the third `-2`, ...
fn anchors(text: &str) -> HashSet<String> {
    let lines = prose_lines(text);
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = HashSet::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(line) = line else { continue };
        let heading = atx_heading(line).map(str::to_owned).or_else(|| {
            // A setext heading: a line of `=` or `-` under a paragraph line.
            let underline = line.trim();
            let is_underline = !underline.is_empty()
                && (underline.chars().all(|c| c == '=') || underline.chars().all(|c| c == '-'));
            let above = i.checked_sub(1).and_then(|j| lines[j].as_deref())?;
            (is_underline
                && !above.trim().is_empty()
                && atx_heading(above).is_none()
                && !above.trim_start().starts_with(['|', '-', '*', '>']))
            .then(|| above.trim().to_owned())
        });
        let Some(heading) = heading else { continue };
        let base = slug(&heading);
        let count = seen.entry(base.clone()).or_insert(0);
        let anchor = if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        };
        *count += 1;
        anchors.insert(anchor);
    }
    anchors
}

/// The link targets of one line of prose: inline links and images
/// `[text](target "title")`, and reference definitions `[label]: target`.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[')
        && let Some(end) = trimmed.find("]:")
    {
        let target = trimmed[end + 2..].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_owned());
        return targets;
    }
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let mut depth = 1;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let inside = after[..end].trim();
        let target = if let Some(bracketed) = inside.strip_prefix('<') {
            bracketed.split('>').next().unwrap_or("")
        } else {
            inside.split_whitespace().next().unwrap_or("")
        };
        targets.push(target.to_owned());
        rest = &after[end.min(after.len())..];
    }
    targets
}

/// `a%20b` -> `a b`.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        if bytes[i] == b'%'
            && let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `docs/../README.md` -> `README.md`; `None` when it climbs out of the root.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// Why a link from `doc` to `target` is broken, if it is.
fn broken(
    root: &Path,
    doc: &Path,
    target: &str,
    anchors_of: &mut HashMap<PathBuf, HashSet<String>>,
) -> Option<String> {
    if target.is_empty() {
        return Some("empty link".into());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        doc.to_path_buf()
    } else {
        let joined = if let Some(from_root) = path.strip_prefix('/') {
            PathBuf::from(percent_decode(from_root))
        } else {
            doc.parent()
                .unwrap_or(Path::new(""))
                .join(percent_decode(path))
        };
        match normalize(&joined) {
            Some(file) => file,
            None => return Some("points outside the repository".into()),
        }
    };
    let on_disk = root.join(&file);
    if !on_disk.exists() {
        return Some(format!("no file {}", file.display()));
    }
    let anchor = anchor?;
    if on_disk.is_dir() {
        return Some(format!(
            "{} is a directory, with no anchors",
            file.display()
        ));
    }
    if file.extension().is_none_or(|e| e != "md") {
        // Line anchors of source files (`#L10`) are GitHub's, not headings.
        return None;
    }
    let known = anchors_of
        .entry(file.clone())
        .or_insert_with(|| anchors(&fs::read_to_string(&on_disk).unwrap_or_default()));
    let anchor = percent_decode(anchor).to_lowercase();
    (!known.contains(&anchor)).then(|| format!("no heading #{anchor} in {}", file.display()))
}

fn is_external(target: &str) -> bool {
    // A scheme: letters (and `+-.`) then `:`, before any `/`, `#` or `?`.
    match target.find(':') {
        Some(colon) => {
            let scheme = &target[..colon];
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        }
        None => false,
    }
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = repo_root();
    let docs = documents(&root);
    assert!(
        docs.iter().any(|d| d == Path::new("README.md")),
        "README.md not found under {}",
        root.display()
    );
    let mut anchors_of = HashMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = fs::read_to_string(root.join(doc)).expect("a document reads as UTF-8");
        for (number, line) in prose_lines(&text).iter().enumerate() {
            let Some(line) = line else { continue };
            for target in link_targets(line) {
                if is_external(&target) {
                    continue;
                }
                checked += 1;
                if let Some(why) = broken(&root, doc, &target, &mut anchors_of) {
                    problems.push(format!(
                        "{}:{}: {target} ({why})",
                        doc.display(),
                        number + 1
                    ));
                }
            }
        }
    }
    assert!(checked > 0, "no relative link found in {docs:?}");
    assert!(
        problems.is_empty(),
        "{} broken link(s) in the documentation:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn slugs_follow_githubs_rules() {
    assert_eq!(
        slug("Several nodes on DynamoDB"),
        "several-nodes-on-dynamodb"
    );
    assert_eq!(
        slug("Switching from autopush-rs, node by node, and back"),
        "switching-from-autopush-rs-node-by-node-and-back"
    );
    assert_eq!(
        slug("Receipts: what became of a push"),
        "receipts-what-became-of-a-push"
    );
    assert_eq!(
        slug("The router key (node-to-node calls)"),
        "the-router-key-node-to-node-calls"
    );
    assert_eq!(
        slug("`autopush check` and [TLS](tls.md)"),
        "autopush-check-and-tls"
    );
    assert_eq!(slug("snake_case stays"), "snake_case-stays");
    assert_eq!(slug("Bridges (2026-11-25)"), "bridges-2026-11-25");
    let text = "# A\n\n```sh\n# not a heading\n```\n\n## A\n\nB\n-\n### a\n";
    let found = anchors(text);
    let want: HashSet<String> = ["a", "a-1", "b", "a-2"].map(String::from).into();
    assert_eq!(found, want);
}

#[test]
fn links_are_found_where_markdown_has_them() {
    let line = blank_code_spans("see [x](a.md#b), `[no](c.md)` and ![img](d.png \"t\")");
    assert_eq!(link_targets(&line), ["a.md#b", "d.png"]);
    assert_eq!(link_targets("[ref]: docs/x.md#y"), ["docs/x.md#y"]);
    assert_eq!(link_targets("[a (b)](f(1).md)"), ["f(1).md"]);
    assert!(is_external("https://example.com/x"));
    assert!(is_external("mailto:ops@example.com"));
    assert!(!is_external("docs/a.md#b:c"));
    assert!(!is_external("#anchor"));
    assert_eq!(percent_decode("a%20b%2"), "a b%2");
    assert_eq!(percent_decode("%é"), "%é");
}
