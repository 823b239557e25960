//! Data files written for a test, and files a job wrote, read back.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow::record_batch::RecordBatch;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::properties::WriterProperties;

/// Writes `batch` as a Parquet file at `path`, in row groups of `row_group_rows` rows when
/// given (else the writer's default).
pub fn write_parquet(path: &Path, batch: &RecordBatch, row_group_rows: Option<usize>) {
    let properties = row_group_rows.map(|rows| {
        WriterProperties::builder()
            .set_max_row_group_row_count(Some(rows))
            .build()
    });
    write(path, batch, properties);
}

/// Writes `batch` as a Parquet file at `path` with the writer `properties` (codec, row
/// groups, …).
pub fn write_parquet_with(path: &Path, batch: &RecordBatch, properties: WriterProperties) {
    write(path, batch, Some(properties));
}

fn write(path: &Path, batch: &RecordBatch, properties: Option<WriterProperties>) {
    let mut writer =
        ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), properties).unwrap();
    writer.write(batch).unwrap();
    writer.close().unwrap();
}

/// Every batch of the `.parquet` files in `dir`, file by file in name order; panics when
/// there is none.
pub fn read_parquet_dir(dir: &Path) -> Vec<RecordBatch> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "parquet"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no parquet files in {}", dir.display());
    files
        .iter()
        .flat_map(|path| {
            ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap())
                .unwrap()
                .build()
                .unwrap()
                .map(Result::unwrap)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The compressed bytes of column `name` over every row group of the Parquet file at `path`:
/// what a reader fetching only that column transfers.
pub fn parquet_column_bytes(path: &Path, name: &str) -> u64 {
    use parquet::file::reader::FileReader;
    let reader =
        parquet::file::serialized_reader::SerializedFileReader::new(File::open(path).unwrap())
            .unwrap();
    reader
        .metadata()
        .row_groups()
        .iter()
        .flat_map(|group| group.columns())
        .filter(|column| column.column_path().string() == name)
        .map(|column| column.byte_range().1)
        .sum()
}
