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

test('ages, in the words of the magic and the panel', () => {
  const now = 1_000_000;
  assert.equal(format.formatAge(now - 12, now), 'just now');
  assert.equal(format.formatAge(now - 300, now), '5 min ago');
  assert.equal(format.formatAge(now - 3 * 3600, now), '3 h ago');
  assert.equal(format.formatAge(now - 30 * 3600, now), '30 h ago');
  assert.equal(format.formatAge(now - 3 * 86400, now), '3 days ago');
  assert.equal(format.formatAge(now + 5, now), 'just now'); // clocks a little apart
});

test('time left: once the rate is known, never at the very start or end', () => {
  assert.equal(format.estimateSecondsLeft(undefined, 5), undefined);
  assert.equal(format.estimateSecondsLeft(0.01, 5), undefined);
  assert.equal(format.estimateSecondsLeft(0.5, 0.5), undefined);
  assert.equal(format.estimateSecondsLeft(1, 5), undefined);
  assert.equal(format.estimateSecondsLeft(0.25, 3), 9);
  assert.equal(format.formatEta(9), 'about 9 s left');
  assert.equal(format.formatEta(0.2), 'about 1 s left');
  assert.equal(format.formatEta(130), 'about 3 min left');
  const job = { phase: 'dump', done: 256 * MiB, total: 1024 * MiB };
  assert.equal(
    format.describeProgress(job, 9),
    'writing memory: 256.0 MiB of 1.0 GiB, about 9 s left'
  );
});

test('a running job never fills the notification bar (that kept success toasts open)', () => {
  assert.equal(format.toastProgress({ phase: 'commit', done: 5, total: 5 }), 0.99);
  assert.equal(format.toastProgress({ phase: 'dump', done: 1, total: 4 }), 0.25);
  assert.equal(format.toastProgress({ phase: 'suspend', done: 0, total: 0 }), undefined);
});

test('a finished restore does not read "done…"', () => {
  assert.equal(format.describeProgress({ phase: 'done', done: 0, total: 0 }), 'finishing…');
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
