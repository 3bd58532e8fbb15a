//! Reading a `config.json`'s fields, with messages that name the field and its value.

use serde_json::{Map, Value};

/// Reads a positive integer field; a missing or `null` field is `None`.
pub fn positive(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => match value.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!(
                "`{key}` is {value}, expected a positive integer below 2^32"
            )),
        },
    }
}

pub fn required(obj: &Map<String, Value>, key: &str, why: &str) -> Result<u32, String> {
    positive(obj, key)?.ok_or_else(|| format!("`{key}` is missing ({why})"))
}

/// `hidden_size / num_attention_heads`, the head dimension of configs without `head_dim`.
pub fn head_dim_from_hidden(obj: &Map<String, Value>, fallback_for: &str) -> Result<u32, String> {
    let why = format!("needed to derive the head dimension without `{fallback_for}`");
    let hidden = required(obj, "hidden_size", &why)?;
    let heads = required(obj, "num_attention_heads", &why)?;
    if hidden % heads != 0 {
        return Err(format!(
            "`hidden_size` {hidden} is not a multiple of `num_attention_heads` {heads}, so the \
             head dimension is unclear; add `{fallback_for}` to the config"
        ));
    }
    Ok(hidden / heads)
}

/// A list of strings; a missing or `null` field is `None`.
pub fn string_list<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<Vec<&'a str>>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| format!("`{key}` holds {v}, expected strings"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(other) => Err(format!("`{key}` is {other}, expected a list of strings")),
    }
}
