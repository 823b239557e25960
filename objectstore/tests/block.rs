//! Arrow blocks in the store: round trips, and decoding that does not copy column data.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

#[allow(dead_code)] // each test binary uses a different subset of the helpers
mod common;

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use common::{MIB, on_every_backing, store_in};
use floe_core::ObjectId;
use floe_core::hash::xxh3_64;
use floe_objectstore::block::{
    encode_into, encoded_checksum, encoded_len, read_block, write_block,
};
use floe_objectstore::{Backing, Error, StoreClient};

on_every_backing!(
    decoded_column_buffers_lie_inside_the_mapping,
    an_empty_block_keeps_its_schema,
    an_object_that_is_not_a_block_is_an_error_naming_it,
);

fn sample(rows: i64, offset: i64) -> RecordBatch {
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(offset..offset + rows));
    let scores: ArrayRef = Arc::new(Float64Array::from_iter(
        (0..rows).map(|i| (i % 3 != 0).then_some(i as f64 * 0.5)),
    ));
    let names: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|i| format!("name-{}", offset + i)),
    ));
    RecordBatch::try_from_iter([("id", ids), ("score", scores), ("name", names)]).unwrap()
}

/// Every buffer of every column, including nested children.
fn buffer_ranges(array: &dyn Array) -> Vec<(usize, usize)> {
    let data = array.to_data();
    let mut ranges: Vec<(usize, usize)> = data
        .buffers()
        .iter()
        .map(|buffer| (buffer.as_ptr() as usize, buffer.len()))
        .collect();
    if let Some(nulls) = data.nulls() {
        let buffer = nulls.buffer();
        ranges.push((buffer.as_ptr() as usize, buffer.len()));
    }
    for child in data.child_data() {
        ranges.extend(buffer_ranges(&arrow::array::make_array(child.clone())));
    }
    ranges
}

fn decoded_column_buffers_lie_inside_the_mapping(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 8 * MIB, MIB, backing);
    let batches = vec![sample(1000, 0), sample(2500, 1000)];
    let schema = batches[0].schema();
    let object = ObjectId::new(1);
    let len = write_block(&store, object, &schema, &batches).unwrap();

    let view = store.get(object).unwrap();
    assert_eq!(view.len() as u64, len);
    let block = read_block(&view).unwrap();
    assert_eq!(block.schema, schema);
    assert_eq!(block.batches, batches);
    assert_eq!(block.num_rows(), 3500);

    let start = view.as_bytes().as_ptr() as usize;
    let end = start + view.len();
    let mut checked = 0;
    for batch in &block.batches {
        for column in batch.columns() {
            for (ptr, len) in buffer_ranges(column.as_ref()) {
                assert!(
                    ptr >= start && ptr + len <= end,
                    "a buffer at {ptr:#x}+{len} was copied out of the object at {start:#x}..{end:#x}"
                );
                checked += 1;
            }
        }
    }
    // ids: values; scores: values + nulls; names: offsets + values — per batch.
    assert_eq!(checked, 2 * 5);

    // The decoded arrays keep the object pinned after the view is gone.
    drop(view);
    store.delete(object).unwrap();
    assert!(store.stats().used > 0);
    let ids = block.batches[1]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap();
    assert_eq!(ids.value(0), 1000);
    drop(block);
    assert_eq!(store.stats().used, 0);
}

#[test]
fn a_block_decodes_zero_copy_through_a_client_mapping_too() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, Backing::SharedMemory);
    let batches = vec![sample(300, 0)];
    let object = ObjectId::new(2);
    write_block(&store, object, &batches[0].schema(), &batches).unwrap();
    let pin = store.get(object).unwrap();
    let client = StoreClient::new();
    let view = client.open(pin.location()).unwrap();
    // A separate mapping of the same segment: different addresses, same bytes.
    assert_ne!(view.as_bytes().as_ptr(), pin.as_bytes().as_ptr());
    let block = read_block(&view).unwrap();
    assert_eq!(block.batches, batches);
    let start = view.as_bytes().as_ptr() as usize;
    let ids = block.batches[0].column(0).to_data();
    let values = ids.buffers()[0].as_ptr() as usize;
    assert!(values >= start && values < start + view.len());
}

fn an_empty_block_keeps_its_schema(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, backing);
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
    write_block(&store, ObjectId::new(3), &schema, &[]).unwrap();
    let block = read_block(&store.get(ObjectId::new(3)).unwrap()).unwrap();
    assert_eq!(block.schema, schema);
    assert!(block.batches.is_empty());
}

fn an_object_that_is_not_a_block_is_an_error_naming_it(backing: Backing) {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path(), 4 * MIB, MIB, backing);
    let object = ObjectId::new(4);
    store.put(object, b"definitely not arrow").unwrap();
    let error = read_block(&store.get(object).unwrap()).unwrap_err();
    assert!(
        matches!(&error, Error::Block { object: o, .. } if *o == object),
        "{error}"
    );
    assert!(error.to_string().contains(&object.to_string()));
}

/// The checksum a block is sealed with is the xxh3-64 of its bytes, whether its column buffers
/// are smaller than one step of the copy-and-hash, exactly one, or many steps and a part.
#[test]
fn a_blocks_checksum_is_the_hash_of_the_bytes_written_whatever_its_buffer_sizes() {
    // One schema for every batch, whether or not it happens to hold a null score.
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("score", DataType::Float64, true),
        Field::new("name", DataType::Utf8, false),
    ]));
    for rows in [0, 1, 1_000, 1_024, 5_000, 200_001] {
        let batches: Vec<RecordBatch> = [sample(rows, 7), sample(rows / 3, rows)]
            .iter()
            .map(|batch| RecordBatch::try_new(schema.clone(), batch.columns().to_vec()).unwrap())
            .collect();
        let mut dest = vec![0u8; encoded_len(&schema, &batches).unwrap() as usize];
        let checksum = encode_into(&mut dest, &schema, &batches, None).unwrap();
        assert_eq!(checksum, xxh3_64(&dest), "{rows} rows");
        assert_eq!(
            encoded_checksum(&schema, &batches, None).unwrap(),
            checksum,
            "{rows} rows"
        );

        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path(), 64 * MIB, MIB, Backing::SharedMemory);
        let object = ObjectId::new(5);
        write_block(&store, object, &schema, &batches).unwrap();
        let view = store.get(object).unwrap();
        assert_eq!(view.as_bytes(), dest.as_slice(), "{rows} rows");
        assert_eq!(store.checksum(object), Some(checksum), "{rows} rows");
        assert_eq!(read_block(&view).unwrap().batches, batches, "{rows} rows");
    }
}

/// Late buffers: a batch whose `id` values are a stand-in (here zeros, recognized by address)
/// encodes to the bytes of the batch with the real values, hashed the same way, whether
/// written or only hashed.
#[test]
fn a_late_buffers_real_bytes_are_written_and_hashed_in_its_place() {
    use arrow::buffer::Buffer;
    use floe_objectstore::block::LateBuffers;

    struct Late {
        stand_in: Buffer,
        real: Buffer,
    }
    impl LateBuffers for Late {
        fn is_stand_in(&self, buffer: &[u8]) -> bool {
            buffer.as_ptr() == self.stand_in.as_ptr()
        }

        fn write_in_place(
            &self,
            stand_in: &[u8],
            dest: &mut [u8],
            written: &mut dyn FnMut(&[u8]),
        ) -> Result<(), arrow::error::ArrowError> {
            assert_eq!(stand_in.len(), self.real.len());
            // In two pieces, as a gather reports them.
            let half = dest.len() / 2;
            dest[..half].copy_from_slice(&self.real[..half]);
            written(&dest[..half]);
            dest[half..].copy_from_slice(&self.real[half..]);
            written(&dest[half..]);
            Ok(())
        }
    }

    let real = sample(10_000, 3);
    let schema = real.schema();
    let zeros: ArrayRef = Arc::new(Int64Array::from(vec![0; 10_000]));
    let mut columns = real.columns().to_vec();
    columns[0] = zeros.clone();
    let layout = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let late = Late {
        stand_in: zeros.to_data().buffers()[0].clone(),
        real: real.column(0).to_data().buffers()[0].clone(),
    };

    let expected_len = encoded_len(&schema, std::slice::from_ref(&real)).unwrap();
    assert_eq!(
        encoded_len(&schema, std::slice::from_ref(&layout)).unwrap(),
        expected_len
    );
    let mut expected = vec![0u8; expected_len as usize];
    encode_into(&mut expected, &schema, std::slice::from_ref(&real), None).unwrap();
    let mut dest = vec![0u8; expected_len as usize];
    let checksum = encode_into(
        &mut dest,
        &schema,
        std::slice::from_ref(&layout),
        Some(&late),
    )
    .unwrap();
    assert!(
        dest == expected,
        "the late values were not written in place"
    );
    assert_eq!(checksum, xxh3_64(&expected));
    assert_eq!(
        encoded_checksum(&schema, std::slice::from_ref(&layout), Some(&late)).unwrap(),
        checksum
    );
    // Without the hook, the stand-in's zeros are what gets written.
    let mut plain = vec![0u8; expected_len as usize];
    encode_into(&mut plain, &schema, std::slice::from_ref(&layout), None).unwrap();
    assert!(plain != expected);
}
