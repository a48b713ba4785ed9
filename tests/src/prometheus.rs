//! A small parser for the Prometheus text exposition format, so tests read
//! scraped metrics as numbers instead of grepping text.

use std::collections::BTreeMap;

/// One scrape: every sample by metric name and its labels.
#[derive(Debug, Default)]
pub struct Scrape {
    samples: BTreeMap<(String, BTreeMap<String, String>), f64>,
}

impl Scrape {
    /// Parse the text of a `/metrics` response; panics on a malformed line.
    pub fn parse(text: &str) -> Scrape {
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("no value on line {line:?}"));
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse()
                    .unwrap_or_else(|e| panic!("bad value on {line:?}: {e}")),
            };
            let (name, labels) = match series.split_once('{') {
                None => (series.to_string(), BTreeMap::new()),
                Some((name, rest)) => {
                    let body = rest
                        .strip_suffix('}')
                        .unwrap_or_else(|| panic!("unclosed labels on {line:?}"));
                    (name.to_string(), parse_labels(body, line))
                }
            };
            assert!(
                samples.insert((name, labels), value).is_none(),
                "duplicate series on {line:?}"
            );
        }
        Scrape { samples }
    }

    /// The value of the series `name` with exactly `labels`, if present.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples.get(&(name.to_string(), labels)).copied()
    }

    /// Like [`Scrape::get`], with 0 for a series never recorded.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// The sum of every series named `name`, whatever its labels.
    pub fn sum(&self, name: &str) -> f64 {
        self.series(name).map(|(_, v)| v).sum()
    }

    /// Every series named `name`, with its labels.
    pub fn series<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Iterator<Item = (&'a BTreeMap<String, String>, f64)> + 'a {
        self.samples
            .iter()
            .filter(move |((n, _), _)| n == name)
            .map(|((_, labels), v)| (labels, *v))
    }

    /// Every label value seen anywhere (to check what may never appear).
    pub fn label_values(&self) -> impl Iterator<Item = &str> {
        self.samples
            .keys()
            .flat_map(|(_, labels)| labels.values().map(String::as_str))
    }
}

/// `a="x",b="y\"z"` into a map, honouring the format's escapes.
fn parse_labels(body: &str, line: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("bad label on {line:?}"));
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => panic!("bad escape on {line:?}"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => panic!("unterminated label value on {line:?}"),
            }
        };
        labels.insert(key.trim_start_matches(',').to_string(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_series_labels_and_escapes() {
        let scrape = Scrape::parse(
            "# TYPE a counter\na 3\nb{x=\"1\",y=\"q\\\"r\"} 2.5\nc_bucket{le=\"+Inf\"} 7\n",
        );
        assert_eq!(scrape.get("a", &[]), Some(3.0));
        assert_eq!(scrape.get("b", &[("x", "1"), ("y", "q\"r")]), Some(2.5));
        assert_eq!(scrape.get("b", &[("x", "1")]), None);
        assert_eq!(scrape.value("c_bucket", &[("le", "+Inf")]), 7.0);
        assert_eq!(scrape.sum("b"), 2.5);
    }
}
