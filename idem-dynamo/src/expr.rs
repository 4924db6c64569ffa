//! The condition and update expressions, one set per transition.
//!
//! Placeholders are `#attribute_name` (bound to the attribute of the same name) and `:value`
//! (bound by the store). Only placeholders are ever interpolated: user data travels as values.

use std::collections::{HashMap, HashSet};

use aws_sdk_dynamodb::types::AttributeValue;

/// Acquire, the one write of the common paths. The values are chosen with `if_not_exists` so that
/// the same expression gives a fresh record (no item, or an item past retention whose
/// `attempts`, `created_us` and `fingerprint` were moved to `final_*` when it finished) and a
/// re-acquired one (in progress past its lease, released, failed retryable: the three attributes
/// are kept, so attempts go up by one and the original fingerprint and creation time stay).
/// The token is the old one plus one, or the client clock in microseconds plus one when there is
/// no item.
pub(crate) const ACQUIRE_UPDATE: &str = "SET #state = :in_progress, \
     #token = if_not_exists(#token, :now) + :one, \
     #owner = :owner, \
     #attempts = if_not_exists(#attempts, :zero) + :one, \
     #created_us = if_not_exists(#created_us, :now), \
     #fingerprint = if_not_exists(#fingerprint, :fp), \
     #lease_expires_us = :lease, \
     #updated_us = :now, \
     #namespace = :namespace, \
     #id = :id, \
     #acq_id = :acq_id, \
     #acq_prev = if_not_exists(#state, :absent) \
     REMOVE #result, #error, #expires_us, #ttl, #final_attempts, #final_created_us, #final_fingerprint";

/// The rows of the contract table where acquire writes. An item without `state` is a tombstone
/// left by [`DELETE_UPDATE`]: absent, taken fresh (the token counts on from it). An item past retention is only taken
/// fresh here when it is final (no `attempts`): a failed-retryable item past retention still has
/// its live attributes and is re-created by [`REFRESH_UPDATE`] instead.
///
/// First of all, the item must not carry this call's `acq_id`: each call writes at most once.
/// A copy of the request that arrives late (the SDK sent it again after an attempt timed out,
/// and the first copy was still on its way) is refused once the call's acquisition landed,
/// whatever happened to the record since: without this, after the holder released or failed
/// the record, the late copy took the key again, under a lease nobody holds and with an
/// attempt counted for a handler that never ran. (The call recognises its own acquisition from
/// the refusal: its `acq_id` in the item as it is.)
const ACQUIRE_WRITE_ROWS: &str = "(attribute_not_exists(#acq_id) OR #acq_id <> :acq_id) AND ( \
     attribute_not_exists(#pk) \
     OR attribute_not_exists(#state) \
     OR (#expires_us <= :now AND attribute_not_exists(#attempts)) \
     OR (FP #attempts < :max AND ( \
           (#state = :in_progress AND #lease_expires_us <= :now) \
           OR #state = :released \
           OR (#state = :failed_retryable AND #expires_us > :now))))";

/// The fingerprint rule, when the request has one: no write when both are present and differ.
const FINGERPRINT_MATCHES: &str = "(attribute_not_exists(#fingerprint) \
     OR attribute_type(#fingerprint, :null_type) OR #fingerprint = :fp) AND";

/// The acquire condition, with or without the fingerprint rule.
pub(crate) fn acquire_condition(with_fingerprint: bool) -> String {
    ACQUIRE_WRITE_ROWS.replace(
        "FP",
        if with_fingerprint {
            FINGERPRINT_MATCHES
        } else {
            ""
        },
    )
}

/// Re-creates a failed-retryable item that is past retention as a fresh record (attempt 1, the
/// request's fingerprint, created now), compare-and-swapped on the token seen.
pub(crate) const REFRESH_UPDATE: &str = "SET #state = :in_progress, \
     #token = #token + :one, \
     #owner = :owner, \
     #attempts = :one, \
     #created_us = :now, \
     #fingerprint = :fp, \
     #lease_expires_us = :lease, \
     #updated_us = :now, \
     #namespace = :namespace, \
     #id = :id, \
     #acq_id = :acq_id, \
     #acq_prev = if_not_exists(#state, :absent) \
     REMOVE #result, #error, #expires_us, #ttl, #final_attempts, #final_created_us, #final_fingerprint";

pub(crate) const REFRESH_CONDITION: &str =
    "#token = :seen AND #state = :failed_retryable AND #expires_us <= :now";

/// `delete`: a tombstone keeps only the key and the token (so the next acquire counts on from
/// it instead of restarting from a client clock) and a TTL a week ahead, after which DynamoDB
/// removes it. Only an existing item is touched.
pub(crate) const DELETE_UPDATE: &str = "SET #ttl = :ttl \
     REMOVE #state, #owner, #attempts, #created_us, #fingerprint, #final_attempts, \
     #final_created_us, #final_fingerprint, #lease_expires_us, #updated_us, #expires_us, \
     #result, #error, #namespace, #id, #acq_id, #acq_prev";

pub(crate) const DELETE_CONDITION: &str = "attribute_exists(#pk)";

/// Every fenced transition: the item exists, is in progress, carries the lease's token and is not
/// past retention.
pub(crate) const FENCE: &str = "#token = :token AND #state = :in_progress \
     AND (attribute_not_exists(#expires_us) OR #expires_us > :now)";

pub(crate) const EXTEND_UPDATE: &str = "SET #lease_expires_us = :lease, #updated_us = :now";

/// Completion makes the record final: `attempts`, `created_us` and `fingerprint` move to
/// `final_*` so that, past retention, [`ACQUIRE_UPDATE`] starts over from them.
pub(crate) const COMPLETE_UPDATE: &str = "SET #state = :completed, #result = :result, \
     #updated_us = :now, #expires_us = :expires, #ttl = :ttl, \
     #final_attempts = #attempts, #final_created_us = #created_us, \
     #final_fingerprint = if_not_exists(#fingerprint, :null) \
     REMOVE #lease_expires_us, #attempts, #created_us, #fingerprint, #error";

/// A final failure (terminal, or result not stored) makes the record final like a completion.
/// `:failed` is the state's name, which carries the failure kind.
pub(crate) const FAIL_FINAL_UPDATE: &str = "SET #state = :failed, #error = :error, \
     #updated_us = :now, #expires_us = :expires, #ttl = :ttl, \
     #final_attempts = #attempts, #final_created_us = #created_us, \
     #final_fingerprint = if_not_exists(#fingerprint, :null) \
     REMOVE #lease_expires_us, #attempts, #created_us, #fingerprint, #result";

/// A retryable failure keeps the live attributes: the next acquire counts on from them.
pub(crate) const FAIL_RETRYABLE_UPDATE: &str = "SET #state = :failed, #error = :error, \
     #updated_us = :now, #expires_us = :expires, #ttl = :ttl \
     REMOVE #lease_expires_us, #result";

/// Release gives the attempt back.
pub(crate) const RELEASE_UPDATE: &str = "SET #state = :released, \
     #attempts = #attempts - :one, #updated_us = :now \
     REMOVE #lease_expires_us";

fn placeholders(expressions: &[&str], sigil: char) -> HashSet<String> {
    let mut found = HashSet::new();
    for expression in expressions {
        let mut rest = *expression;
        while let Some(at) = rest.find(sigil) {
            let tail = &rest[at + 1..];
            let len = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            found.insert(tail[..len].to_owned());
            rest = &tail[len..];
        }
    }
    found
}

/// `#name -> name` for every name placeholder in `expressions`.
pub(crate) fn names(expressions: &[&str]) -> HashMap<String, String> {
    placeholders(expressions, '#')
        .into_iter()
        .map(|name| (format!("#{name}"), name))
        .collect()
}

/// The values of `values` that `expressions` use (DynamoDB refuses unused ones).
///
/// # Panics
/// In debug builds, when an expression uses a value that is not given: a bug in this crate.
pub(crate) fn values(
    expressions: &[&str],
    values: Vec<(&'static str, AttributeValue)>,
) -> HashMap<String, AttributeValue> {
    let used = placeholders(expressions, ':');
    let given: HashMap<String, AttributeValue> = values
        .into_iter()
        .filter(|(name, _)| used.contains(*name))
        .map(|(name, value)| (format!(":{name}"), value))
        .collect();
    debug_assert_eq!(given.len(), used.len(), "{used:?} in {expressions:?}");
    given
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_found() {
        let names = names(&["SET #a = :x, #b_c = if_not_exists(#a, :y)", "#d <= :x"]);
        assert_eq!(names.len(), 3);
        assert_eq!(names["#b_c"], "b_c");
        let values = values(
            &["SET #a = :x", "#b = :y"],
            vec![
                ("x", AttributeValue::N("1".into())),
                ("y", AttributeValue::N("2".into())),
                ("unused", AttributeValue::N("3".into())),
            ],
        );
        assert_eq!(values.len(), 2);
        assert!(values.contains_key(":x") && values.contains_key(":y"));
    }

    #[test]
    fn fingerprint_rule_only_when_asked() {
        assert!(acquire_condition(true).contains("attribute_type(#fingerprint"));
        assert!(!acquire_condition(false).contains("fingerprint"));
        assert!(!acquire_condition(false).contains("FP"));
    }

    #[test]
    fn every_name_is_an_attribute() {
        use crate::item::attr;
        let known = [
            attr::PK,
            attr::NAMESPACE,
            attr::ID,
            attr::STATE,
            attr::TOKEN,
            attr::OWNER,
            attr::ATTEMPTS,
            attr::CREATED,
            attr::FINGERPRINT,
            attr::FINAL_ATTEMPTS,
            attr::FINAL_CREATED,
            attr::FINAL_FINGERPRINT,
            attr::LEASE,
            attr::UPDATED,
            attr::EXPIRES,
            attr::TTL,
            attr::RESULT,
            attr::ERROR,
            attr::ACQ_ID,
            attr::ACQ_PREV,
        ];
        let condition = acquire_condition(true);
        let all = [
            ACQUIRE_UPDATE,
            condition.as_str(),
            REFRESH_UPDATE,
            REFRESH_CONDITION,
            FENCE,
            EXTEND_UPDATE,
            COMPLETE_UPDATE,
            FAIL_FINAL_UPDATE,
            FAIL_RETRYABLE_UPDATE,
            RELEASE_UPDATE,
            DELETE_UPDATE,
            DELETE_CONDITION,
        ];
        for name in names(&all).values() {
            assert!(known.contains(&name.as_str()), "{name}");
        }
    }
}
