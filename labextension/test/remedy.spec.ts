/**
 * Who holds the ports of a refused restore, read from the server's error code and details,
 * never from its English text.
 */
import type { IJobError } from '../src/api';
import { PortsHolder, portsHolder } from '../src/remedy';
import { portsRefusal } from './fixtures';

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
