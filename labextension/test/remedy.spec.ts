/**
 * Who holds the ports of a refused restore, read from the server's error code and details,
 * never from its English text.
 */
import { type IJobError, SnapshotAPIError } from '../src/api';
import {
  PortsHolder,
  describeRefusal,
  heldByRunningKernel,
  portsHolder
} from '../src/remedy';
import { makeSnapshot, portsRefusal } from './fixtures';

const A = { holder_kernel_id: 'k-a', holder_notebook_path: 'work/a.ipynb' };

/** Each row: who holds, the refusal's details, the asking notebook's kernel, the answer. */
const holders: [string, IJobError['details'], string | null, PortsHolder][] = [
  [
    // Restoring A's snapshot from notebook B: A's kernel holds the ports.
    "another notebook's kernel, by its notebook, never the asking one's",
    A,
    'k-b',
    { kind: 'other-kernel', kernelId: 'k-a', path: 'work/a.ipynb', owner: 'a.ipynb' }
  ],
  ["the notebook's own kernel", A, 'k-a', { kind: 'this-kernel' }],
  [
    'a kernel without a notebook, by its id',
    { holder_kernel_id: 'k-c', holder_notebook_path: null },
    'k-b',
    { kind: 'other-kernel', kernelId: 'k-c', path: null, owner: 'kernel k-c' }
  ],
  [
    'a kernel without a notebook, asked from a notebook without a kernel',
    { holder_kernel_id: 'k-c' },
    null,
    { kind: 'other-kernel', kernelId: 'k-c', path: null, owner: 'kernel k-c' }
  ],
  [
    'a notebook at the root of the server, by its path',
    { holder_kernel_id: 'k-a', holder_notebook_path: 'a.ipynb' },
    'k-b',
    { kind: 'other-kernel', kernelId: 'k-a', path: 'a.ipynb', owner: 'a.ipynb' }
  ],
  [
    'a path without a file name, whole rather than as nothing',
    { holder_kernel_id: 'k-a', holder_notebook_path: 'work/' },
    'k-b',
    { kind: 'other-kernel', kernelId: 'k-a', path: 'work/', owner: 'work/' }
  ],
  [
    // A restore of the snapshot from the command line, say: nobody here to shut down.
    'something outside the server, when no kernel of it holds them',
    { holder_kernel_id: null },
    'k-b',
    { kind: 'outside' }
  ],
  [
    'something outside the server, when the refusal names none',
    undefined,
    'k-b',
    { kind: 'outside' }
  ]
];

describe('portsHolder', () => {
  it.each(holders)('names %s', (_, details, askingKernel, holder) => {
    expect(portsHolder(portsRefusal(details), askingKernel)).toEqual(holder);
  });

  it('offers no port remedy for other errors, whatever their text', () => {
    const text = { step: 'preflight', cause: 'shell port 5 in use', message: 'x' };
    expect(portsHolder({ ...text, code: 'failed' }, 'k')).toBeNull();
    expect(portsHolder(text, 'k')).toBeNull(); // an older server without codes
    expect(portsHolder(null, 'k')).toBeNull();
  });
});

describe('heldByRunningKernel: whether restoring a snapshot replaces the running kernel', () => {
  const ports = (shell: number) => ({
    ip: '127.0.0.1',
    shell_port: shell,
    iopub_port: shell + 1
  });
  const taken = makeSnapshot({
    id: 's-own',
    kernel: { kernel_id: 'k-now', connection_info: ports(5000) }
  });
  const origin = makeSnapshot({
    id: 's-origin',
    kernel: { kernel_id: 'k-first', connection_info: ports(6000) }
  });
  const sibling = makeSnapshot({
    id: 's-sibling',
    kernel: { kernel_id: 'k-first', connection_info: ports(6000) }
  });
  const other = makeSnapshot({
    id: 's-other',
    kernel: { kernel_id: 'k-other', connection_info: ports(7000) }
  });
  const listing = [taken, origin, sibling, other];

  it.each([
    [
      'a snapshot of the running kernel',
      taken,
      { kernelId: 'k-now', originId: null },
      true
    ],
    [
      'the one it was restored from',
      origin,
      { kernelId: 'k-now', originId: 's-origin' },
      true
    ],
    [
      'another of the line it was restored from (the same ports)',
      sibling,
      { kernelId: 'k-now', originId: 's-origin' },
      true
    ],
    ["another kernel's", other, { kernelId: 'k-now', originId: 's-origin' }, false],
    [
      'any, for a notebook without a kernel',
      taken,
      { kernelId: null, originId: null },
      false
    ]
  ])('%s: %s', (_, snapshot, running, held) => {
    expect(heldByRunningKernel(snapshot, running, listing)).toBe(held);
  });
});

describe('describeRefusal: a refused delete or rename in words, from its code', () => {
  const busy = (details: IJobError['details']) =>
    new SnapshotAPIError(
      'delete failed: snapshot s is in use by a restore job (0123456789abcdef0123456789abcdef)',
      409,
      {
        code: 'busy',
        step: 'delete',
        cause: 'snapshot s is in use by a restore job (0123456789abcdef0123456789abcdef)',
        message: 'x',
        details
      }
    );

  it('says what holds a busy snapshot, never the id of the job', () => {
    const text = describeRefusal(
      busy({ in_use_by: 'restore', job_id: '0123456789abcdef0123456789abcdef' })
    );
    expect(text).toBe('it is being restored; try again once the restore has ended');
    expect(describeRefusal(busy({ in_use_by: 'hibernation' }))).toMatch(
      /^a hibernated kernel wakes from it/
    );
  });

  it("gives a refused request's cause alone, and any other error's message", () => {
    const invalid = new SnapshotAPIError('rename failed: invalid snapshot name', 400, {
      code: 'invalid_request',
      step: 'rename',
      cause: "invalid snapshot name 'a/b'",
      message: 'rename failed: invalid snapshot name'
    });
    expect(describeRefusal(invalid)).toBe("invalid snapshot name 'a/b'");
    expect(describeRefusal(new Error('cannot reach the Jupyter server'))).toBe(
      'cannot reach the Jupyter server'
    );
  });
});
