//! The operator's listing on a paginated `Scan`.
//!
//! DynamoDB has no index on the namespace (the partition key is `{namespace}:{id}`), so a
//! listing is a `Scan` of the whole table: each page is one strongly consistent `Scan` request
//! that reads up to 1,000 items, whatever their namespace, and consumes read
//! capacity for all of them. A filter expression keeps the items of the namespace (and, where a
//! status maps onto the `state` attribute, of the states asked for); the status, age and owner
//! filters are then applied here with [`ListQuery::matches`], so a page may hold fewer records
//! than the limit, even none, while more follow.

use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::{Cursor, Error, IdempotencyKey, ListQuery, Page, Record, Result, Status};

use crate::expr;
use crate::item::{Decoder, Item, attr, is_tombstone, s, state};
use crate::store::DynamoStore;

/// How many items one page's `Scan` reads at most ([`MAX_PAGE`](idem_core::MAX_PAGE)).
const SCAN_LIMIT: i32 = 1000;

/// What every cursor of this store starts with (then the hex of the last evaluated `pk`).
const CURSOR_TAG: &str = "dyn1-";

/// The value placeholders for the states of a filter: at most one per [`StateKind`].
const STATE_VALUES: [&str; 6] = ["st0", "st1", "st2", "st3", "st4", "st5"];

/// The `state` values a record of `status` can have.
fn states_of(status: Status) -> &'static [&'static str] {
    match status {
        Status::InProgress | Status::LeaseExpired => &[state::IN_PROGRESS],
        Status::Released => &[state::RELEASED],
        Status::Completed => &[state::COMPLETED],
        Status::FailedRetryable => &[state::FAILED_RETRYABLE],
        Status::FailedTerminal => &[FAILED_TERMINAL],
        Status::ResultNotStored => &[FAILED_RESULT_NOT_STORED],
        Status::Exhausted => &[state::IN_PROGRESS, state::RELEASED, state::FAILED_RETRYABLE],
        // A status added later: no narrowing by state (the client-side filter decides).
        _ => &[],
    }
}

const FAILED_TERMINAL: &str = "failed_terminal";
const FAILED_RESULT_NOT_STORED: &str = "failed_result_not_stored";

/// The distinct `state` values the statuses of `query` can have; `None` for no narrowing.
fn wanted_states(query: &ListQuery) -> Option<Vec<&'static str>> {
    let mut states: Vec<&'static str> = Vec::new();
    for status in &query.statuses {
        let of = states_of(*status);
        if of.is_empty() {
            return None;
        }
        for st in of {
            if !states.contains(st) {
                states.push(st);
            }
        }
    }
    (!states.is_empty() && states.len() <= STATE_VALUES.len()).then_some(states)
}

/// The opaque cursor for the `Scan`'s `LastEvaluatedKey`.
pub(crate) fn encode_cursor(pk: &str) -> Cursor {
    let mut text = String::with_capacity(CURSOR_TAG.len() + 2 * pk.len());
    text.push_str(CURSOR_TAG);
    for byte in pk.as_bytes() {
        text.push_str(&format!("{byte:02x}"));
    }
    Cursor::new(text)
}

/// The `pk` a cursor of this store carries; `InvalidInput` (field `cursor`) for any other text.
pub(crate) fn decode_cursor(cursor: &Cursor) -> Result<String> {
    let foreign = || Error::invalid("cursor", "is not a cursor this DynamoDB store handed out");
    let hex = cursor
        .as_str()
        .strip_prefix(CURSOR_TAG)
        .ok_or_else(foreign)?;
    if hex.is_empty() || hex.len() % 2 != 0 {
        return Err(foreign());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(foreign)?;
    let pk = String::from_utf8(bytes).map_err(|_| foreign())?;
    if !pk.contains(':') {
        return Err(foreign());
    }
    Ok(pk)
}

impl DynamoStore {
    /// One page of [`IdempotencyStore::list`](idem_core::IdempotencyStore::list): one `Scan`
    /// request (see the [module docs](self)) of up to [`SCAN_LIMIT`] items; when more than
    /// `query.limit` of them match, the page ends at the last one kept and the cursor points
    /// there.
    pub(crate) async fn list_page(&self, query: &ListQuery) -> Result<Page> {
        query.validate()?;
        let start = query.cursor.as_ref().map(decode_cursor).transpose()?;
        let prefix = format!("{}:", query.namespace);
        let mut filter =
            String::from("begins_with(#pk, :prefix) AND attribute_type(#state, :string_type)");
        let mut values = vec![("prefix", s(prefix.as_str())), ("string_type", s("S"))];
        if let Some(states) = wanted_states(query) {
            let placeholders: Vec<String> = STATE_VALUES[..states.len()]
                .iter()
                .map(|name| format!(":{name}"))
                .collect();
            filter.push_str(&format!(" AND #state IN ({})", placeholders.join(", ")));
            values.extend(
                STATE_VALUES
                    .iter()
                    .zip(&states)
                    .map(|(name, st)| (*name, s(*st))),
            );
        }
        let expressions = [filter.as_str()];
        let output = self
            .client()
            .scan()
            .table_name(self.table())
            .consistent_read(true)
            .limit(SCAN_LIMIT)
            .filter_expression(filter.as_str())
            .set_expression_attribute_names(Some(expr::names(&expressions)))
            .set_expression_attribute_values(Some(expr::values(&expressions, values)))
            .set_exclusive_start_key(start.map(|pk| [(attr::PK.to_owned(), s(pk))].into()))
            .send()
            .await
            .map_err(|e| self.sdk_error("Scan", e))?;
        let now = self.now_time();
        let items = output.items.unwrap_or_default();
        let mut records = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let Some(AttributeValue::S(pk)) = item.get(attr::PK) else {
                continue;
            };
            let Some(record) = listed(query, &prefix, pk, item)? else {
                continue;
            };
            if record.is_expired(now) || !query.matches(&record, now) {
                continue;
            }
            records.push(record);
            if records.len() == query.limit && i + 1 < items.len() {
                // The page is full before the scanned items end: the next page starts after
                // this item (any key is a valid start for a Scan).
                return Ok(Page::new(records, Some(encode_cursor(pk))));
            }
        }
        let next = match output.last_evaluated_key {
            None => None,
            Some(key) => match key.get(attr::PK) {
                Some(AttributeValue::S(pk)) => Some(encode_cursor(pk)),
                other => {
                    return Err(Error::corrupt(
                        crate::STORE,
                        "Scan",
                        format!("LastEvaluatedKey has no string pk: {other:?}"),
                    ));
                }
            },
        };
        Ok(Page::new(records, next))
    }
}

/// The record `item` (of partition key `pk`) holds, when it is of the namespace and not a
/// tombstone.
fn listed(query: &ListQuery, prefix: &str, pk: &str, item: &Item) -> Result<Option<Record>> {
    if is_tombstone(item) {
        return Ok(None);
    }
    let Some(id) = pk.strip_prefix(prefix) else {
        return Ok(None);
    };
    let key = IdempotencyKey::new(query.namespace.clone(), id)?;
    Decoder::new(item, &key).record().map(Some)
}

#[cfg(test)]
mod tests {
    use idem_core::StateKind;

    use super::*;

    #[test]
    fn cursors_round_trip() {
        for pk in ["ns:a", "ns:é:x", "n:"] {
            assert_eq!(decode_cursor(&encode_cursor(pk)).unwrap(), pk);
        }
    }

    #[test]
    fn foreign_cursors_are_invalid_input() {
        for text in [
            "",
            "dyn1-",
            "dyn1-zz",
            "dyn1-6",
            "6e733a61",
            "dyn1-6e73",
            "dyn1-ff3a",
        ] {
            let err = decode_cursor(&Cursor::new(text)).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidInput {
                        field: "cursor",
                        ..
                    }
                ),
                "{text}: {err:?}"
            );
        }
    }

    #[test]
    fn every_state_kind_is_covered() {
        let named: Vec<&str> = Status::ALL
            .iter()
            .flat_map(|s| states_of(*s))
            .copied()
            .collect();
        for kind in StateKind::ALL {
            assert!(named.contains(&kind.name()), "{}", kind.name());
        }
        let all =
            ListQuery::new(idem_core::Namespace::new("n").unwrap()).with_statuses(Status::ALL);
        assert_eq!(wanted_states(&all).map(|s| s.len()), Some(6));
    }
}
