//! Parquet inputs, read row by row with the `parquet` crate's record API
//! (no Arrow): one column of a file becomes a record per row.
//!
//! - A **string** column (or binary holding UTF-8) is a document per row.
//! - A **list of structs** is a chat per row: `{role, content}` elements as
//!   in `messages`, or ShareGPT's `{from, value}` as in `conversations`
//!   (the first element's fields tell which).
//!
//! The column is the one asked for by name; without a name, the first of
//! `text`, `messages` and `conversations` the file has, else the alpaca
//! columns `instruction` + `output` (with `input` and `system` when
//! present). Anything else is refused with the file's columns and their
//! types listed.

use std::path::Path;

use parquet::basic::{ConvertedType, LogicalType, Repetition, Type as PhysicalType};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use parquet::schema::types::{Type, TypePtr};
use serde_json::Value;

use crate::error::{Error, RecordAt, Result};
use crate::records::{chat_from_list, record_from_value, ChatShape, Record};

/// The columns tried, in order, when none is named.
pub const DEFAULT_COLUMNS: [&str; 3] = ["text", "messages", "conversations"];

const ACCEPTED: &str = "a string column (a document per row) or a list of {role, content} or {from, value} \
                        structs (a chat per row)";

/// A column's type as a reader would write it: `string`, `int64`,
/// `list<struct<role: string, content: string>>`.
pub fn describe(t: &Type) -> String {
    let info = t.get_basic_info();
    // A repeated field without a LIST annotation is a list of its type.
    if info.has_repetition() && info.repetition() == Repetition::REPEATED {
        format!("list<{}>", describe_value(t))
    } else {
        describe_value(t)
    }
}

/// A field's type, not counting a repetition.
fn describe_value(t: &Type) -> String {
    let info = t.get_basic_info();
    if t.is_primitive() {
        let string = matches!(info.logical_type_ref(), Some(LogicalType::String))
            || info.converted_type() == ConvertedType::UTF8;
        return match t.get_physical_type() {
            PhysicalType::BYTE_ARRAY if string => "string".to_string(),
            PhysicalType::BYTE_ARRAY => "binary".to_string(),
            other => other.to_string().to_ascii_lowercase(),
        };
    }
    if matches!(info.logical_type_ref(), Some(LogicalType::List)) || info.converted_type() == ConvertedType::LIST {
        return format!("list<{}>", list_element(t).map(|e| describe_value(&e)).unwrap_or_else(|| "?".into()));
    }
    if matches!(info.logical_type_ref(), Some(LogicalType::Map))
        || matches!(info.converted_type(), ConvertedType::MAP | ConvertedType::MAP_KEY_VALUE)
    {
        return "map".to_string();
    }
    let fields: Vec<String> = t.get_fields().iter().map(|f| format!("{}: {}", f.name(), describe(f))).collect();
    format!("struct<{}>", fields.join(", "))
}

/// The element type of a LIST group, by Parquet's rules for the two- and
/// three-level list layouts.
fn list_element(list: &Type) -> Option<TypePtr> {
    let repeated = list.get_fields().first()?;
    let legacy_name = repeated.name() == "array" || repeated.name() == format!("{}_tuple", list.name());
    if repeated.is_group() && repeated.get_fields().len() == 1 && !legacy_name {
        Some(repeated.get_fields()[0].clone())
    } else {
        Some(repeated.clone())
    }
}

/// What a chosen column holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum ColumnKind {
    Text,
    Chat,
    /// The alpaca columns together, a record per row.
    Alpaca,
}

fn columns_list(fields: &[TypePtr]) -> String {
    fields.iter().map(|f| format!("{} ({})", f.name(), describe(f))).collect::<Vec<_>>().join(", ")
}

fn kind_of(field: &Type, path: &Path) -> Result<ColumnKind> {
    let d = describe(field);
    if d == "string" || d == "binary" {
        Ok(ColumnKind::Text)
    } else if d.starts_with("list<struct<") {
        Ok(ColumnKind::Chat)
    } else {
        Err(Error::record(path, RecordAt::File, format!("column `{}` is {d}; accepted: {ACCEPTED}", field.name())))
    }
}

/// The records of a Parquet file: `column`'s values, or (without a name)
/// the default columns of the module doc.
pub fn read_parquet(path: &Path, column: Option<&str>) -> Result<Vec<(RecordAt, Record)>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, "reading the input", e))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| Error::record(path, RecordAt::File, format!("not a readable Parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema();
    let fields = schema.get_fields();
    let find = |name: &str| fields.iter().find(|f| f.name() == name).cloned();
    let (kind, chosen): (ColumnKind, Vec<TypePtr>) = match column {
        Some(name) => {
            let Some(field) = find(name) else {
                return Err(Error::record(
                    path,
                    RecordAt::File,
                    format!(
                        "no column `{name}`; the file's columns: {}. Pass --column with {ACCEPTED}",
                        columns_list(fields)
                    ),
                ));
            };
            (kind_of(&field, path)?, vec![field])
        }
        None => {
            if let Some(field) = DEFAULT_COLUMNS.iter().find_map(|c| find(c)) {
                (kind_of(&field, path)?, vec![field])
            } else if let (Some(instruction), Some(output)) = (find("instruction"), find("output")) {
                let extra = ["input", "system"].iter().filter_map(|c| find(c));
                (ColumnKind::Alpaca, [instruction, output].into_iter().chain(extra).collect())
            } else {
                return Err(Error::record(
                    path,
                    RecordAt::File,
                    format!(
                        "no column `text` (nor `messages`, `conversations`, or `instruction` + `output`); \
                         the file's columns: {}. Pass --column NAME with {ACCEPTED}",
                        columns_list(fields)
                    ),
                ));
            }
        }
    };
    let name = chosen[0].name().to_string();
    let projection = Type::group_type_builder(schema.name())
        .with_fields(chosen)
        .build()
        .map_err(|e| Error::record(path, RecordAt::File, format!("projecting column `{name}`: {e}")))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| Error::record(path, RecordAt::File, format!("reading column `{name}`: {e}")))?;
    let mut records = Vec::with_capacity(reader.metadata().file_metadata().num_rows().max(0) as usize);
    for (r, row) in rows.enumerate() {
        let at = RecordAt::Row(r);
        let row = row.map_err(|e| Error::record(path, at, format!("reading the row: {e}")))?;
        let record = match kind {
            ColumnKind::Text => {
                let value = row.get_column_iter().next().map(|(_, f)| f);
                match value {
                    Some(Field::Str(s)) => Record::Text(s.clone()),
                    Some(Field::Bytes(b)) => Record::Text(
                        b.as_utf8().map_err(|_| Error::record(path, at, format!("`{name}` is not UTF-8")))?.to_string(),
                    ),
                    Some(Field::Null) | None => {
                        return Err(Error::record(path, at, format!("`{name}` is null")));
                    }
                    Some(other) => return Err(Error::record(path, at, format!("`{name}` is not a string: {other}"))),
                }
            }
            ColumnKind::Chat => {
                let Value::Object(obj) = row.to_json_value() else {
                    unreachable!("a row is a JSON object");
                };
                let list = obj.get(&name).unwrap_or(&Value::Null);
                let shape = match list {
                    Value::Array(items) => ChatShape::of(items),
                    _ => ChatShape::Messages,
                };
                chat_from_list(list, shape, &name, path, at)?
            }
            ColumnKind::Alpaca => record_from_value(&row.to_json_value(), path, at)?,
        };
        records.push((at, record));
    }
    Ok(records)
}
