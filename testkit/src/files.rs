//! Data files written for a test.

use std::fs::File;
use std::path::Path;

use arrow::record_batch::RecordBatch;
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

/// Writes `batch` as a Parquet file at `path`, in row groups of `row_group_rows` rows when
/// given (else the writer's default).
pub fn write_parquet(path: &Path, batch: &RecordBatch, row_group_rows: Option<usize>) {
    let properties = row_group_rows.map(|rows| {
        WriterProperties::builder()
            .set_max_row_group_row_count(Some(rows))
            .build()
    });
    let mut writer =
        ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), properties).unwrap();
    writer.write(batch).unwrap();
    writer.close().unwrap();
}
