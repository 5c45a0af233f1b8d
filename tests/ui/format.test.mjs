// How the extension words sizes, ages, job progress and the GPU column. Runs the compiled
// labextension/lib/format.js (plain ES module without imports) under `node --test`.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { test } from 'node:test';

const source = fs.readFileSync(new URL('../../labextension/lib/format.js', import.meta.url));
const format = await import(`data:text/javascript,${encodeURIComponent(source)}`);

const GiB = 2 ** 30;
const MiB = 2 ** 20;

test('sizes', () => {
  assert.equal(format.formatBytes(512), '512 B');
  assert.equal(format.formatBytes(40.6 * MiB), '40.6 MiB');
  assert.equal(format.formatBytes(1.1 * GiB), '1.1 GiB');
});

test('ages', () => {
  const now = 1_000_000;
  assert.equal(format.formatAge(now - 12, now), '12 s ago');
  assert.equal(format.formatAge(now - 300, now), '5 min ago');
  assert.equal(format.formatAge(now - 3 * 3600, now), '3 h ago');
  assert.equal(format.formatAge(now - 86400, now), '1 day ago');
  assert.equal(format.formatAge(now + 5, now), '0 s ago'); // clocks a little apart
});

test('job progress names the phase and the bytes', () => {
  const job = { phase: 'dump', done: 412 * MiB, total: 1.1 * GiB };
  assert.equal(format.describeProgress(job), 'writing memory: 412.0 MiB of 1.1 GiB');
  assert.equal(format.jobFraction(job), (412 * MiB) / (1.1 * GiB));
  assert.equal(format.describeProgress({ phase: 'suspend', done: 0, total: 0 }), 'pausing the kernel…');
  assert.equal(format.jobFraction({ phase: 'suspend', done: 0, total: 0 }), undefined);
  assert.equal(format.describeProgress({ phase: 'future-phase', done: 0, total: 0 }), 'future-phase…');
});

test('the GPU column', () => {
  assert.equal(format.describeGpu({ gpu: null }), 'CPU only');
  const h100 = { uuid: 'GPU-a', name: 'NVIDIA H100 80GB HBM3' };
  const other = { uuid: 'GPU-b', name: 'NVIDIA H100 80GB HBM3' };
  assert.equal(
    format.describeGpu({
      gpu: {
        devices: [h100, other],
        processes: [{ devices: { 'GPU-a': 66 * MiB } }],
        moved_bytes: 1.1 * GiB
      }
    }),
    'NVIDIA H100 80GB HBM3, 1.1 GiB'
  );
  assert.equal(
    format.describeGpu({
      gpu: {
        devices: [h100, other],
        processes: [{ devices: { 'GPU-a': MiB } }, { devices: { 'GPU-b': MiB } }],
        moved_bytes: 2 * MiB
      }
    }),
    '2× NVIDIA H100 80GB HBM3, 2.0 MiB'
  );
  // A kernel on a GPU machine that never touched CUDA.
  assert.equal(
    format.describeGpu({ gpu: { devices: [h100], processes: [], moved_bytes: 0 } }),
    'no GPU memory'
  );
});

test('the saved notification gives name, size and time', () => {
  assert.equal(
    format.describeSaved({ name: 'before-training', size_bytes: 12.3 * MiB, timings: { total: 0.84 } }),
    "Snapshot saved: 'before-training', 12.3 MiB in 0.84 s"
  );
});
