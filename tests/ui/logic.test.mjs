// The extension's logic that needs no browser: who holds a refused restore's ports, and
// following a job through polls and server events. Runs the compiled labextension/lib files
// (plain ES modules without run-time imports) under `node --test`.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { test } from 'node:test';

async function load(name) {
  const source = fs.readFileSync(new URL(`../../labextension/lib/${name}.js`, import.meta.url));
  return import(`data:text/javascript,${encodeURIComponent(source)}`);
}

const remedy = await load('remedy');
const jobs = await load('jobs');

const refusal = details => ({
  code: 'ports_in_use',
  step: 'preflight',
  cause: 'shell port 5 of 127.0.0.1 in use',
  message: 'preflight failed: …',
  details
});

test('a refusal for taken ports names the kernel that holds them', () => {
  const error = refusal({ holder_kernel_id: 'k-a', holder_notebook_path: 'work/a.ipynb' });
  // Restoring A's snapshot from notebook B: A's kernel, by its notebook; never B's.
  assert.deepEqual(remedy.portsHolder(error, 'k-b'), {
    kind: 'other-kernel',
    kernelId: 'k-a',
    path: 'work/a.ipynb',
    owner: 'a.ipynb'
  });
  assert.deepEqual(remedy.portsHolder(error, 'k-a'), { kind: 'this-kernel' });
  assert.deepEqual(
    remedy.portsHolder(refusal({ holder_kernel_id: 'k-c', holder_notebook_path: null }), 'k-b'),
    { kind: 'other-kernel', kernelId: 'k-c', path: null, owner: 'kernel k-c' }
  );
  // Held by nothing the server runs (a restore from the command line): nobody to shut down.
  assert.deepEqual(remedy.portsHolder(refusal({ holder_kernel_id: null }), 'k-b'), {
    kind: 'outside'
  });
});

test('other errors, whatever their text, offer no port remedy', () => {
  const text = { step: 'preflight', cause: 'shell port 5 in use', message: 'x' };
  assert.equal(remedy.portsHolder({ ...text, code: 'failed' }, 'k'), null);
  assert.equal(remedy.portsHolder(text, 'k'), null); // an older server without codes
  assert.equal(remedy.portsHolder(null, 'k'), null);
});

function job(fields) {
  return { id: 'j1', status: 'running', phase: 'dump', done: 0, total: 100, ...fields };
}

function fakeEvents() {
  const slots = [];
  return {
    stream: {
      connect: (fn, self) => slots.push([fn, self]),
      disconnect: fn => slots.splice(slots.findIndex(([f]) => f === fn), 1)
    },
    emit: payload => slots.forEach(([fn, self]) => fn.call(self, null, payload))
  };
}

test('a followed job reports each new state once and resolves with the last', async () => {
  const states = [job({ done: 50 }), job({ done: 50 }), job({ status: 'succeeded', phase: 'done' })];
  const api = { getJob: async () => states.shift() };
  const follower = new jobs.JobFollower(api, null, 5);
  const seen = [];
  const final = await follower.follow(job({}), current => seen.push(current.done));
  assert.equal(final.status, 'succeeded');
  assert.deepEqual(seen, [0, 50, 0]); // the repeated state is not reported again
});

test('an event of the server wakes the follower before its next poll', async () => {
  const events = fakeEvents();
  const api = { getJob: async () => assert.fail('polled although the event came first') };
  const follower = new jobs.JobFollower(api, events, 60_000);
  const foreign = [];
  follower.jobEvent = j => foreign.push(j.id);
  const done = follower.follow(job({}), () => undefined);
  const schema = `${jobs.JOB_EVENT_PREFIX}v1`;
  events.emit({ schema_id: schema, ...job({ id: 'other' }) });
  events.emit({ schema_id: schema, ...job({ status: 'failed', phase: 'dump' }) });
  const final = await done;
  assert.equal(final.status, 'failed');
  assert.deepEqual(foreign, ['other', 'j1']);
  follower.dispose();
});

test('a server that stops answering ends the follow with its error', async () => {
  const api = {
    getJob: async () => {
      throw new Error('cannot reach the Jupyter server');
    }
  };
  const follower = new jobs.JobFollower(api, null, 1);
  await assert.rejects(follower.follow(job({}), () => undefined), /cannot reach/);
});
