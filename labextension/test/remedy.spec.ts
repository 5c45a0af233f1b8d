/**
 * Who holds the ports of a refused restore, read from the server's error code and details,
 * never from its English text.
 */
import { portsHolder } from '../src/remedy';
import { portsRefusal } from './fixtures';

describe('portsHolder', () => {
  it("names another notebook's kernel by its notebook, never the asking one's", () => {
    // Restoring A's snapshot from notebook B: A's kernel holds the ports.
    const error = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'work/a.ipynb'
    });
    expect(portsHolder(error, 'k-b')).toEqual({
      kind: 'other-kernel',
      kernelId: 'k-a',
      path: 'work/a.ipynb',
      owner: 'a.ipynb'
    });
  });

  it("recognises the notebook's own kernel", () => {
    const error = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'work/a.ipynb'
    });
    expect(portsHolder(error, 'k-a')).toEqual({ kind: 'this-kernel' });
  });

  it('names a kernel without a notebook by its id', () => {
    const error = portsRefusal({ holder_kernel_id: 'k-c', holder_notebook_path: null });
    expect(portsHolder(error, 'k-b')).toEqual({
      kind: 'other-kernel',
      kernelId: 'k-c',
      path: null,
      owner: 'kernel k-c'
    });
    expect(portsHolder(portsRefusal({ holder_kernel_id: 'k-c' }), null)).toMatchObject({
      owner: 'kernel k-c'
    });
  });

  it('names a notebook at the root of the server by its path', () => {
    const error = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'a.ipynb'
    });
    expect(portsHolder(error, 'k-b')).toMatchObject({
      owner: 'a.ipynb',
      path: 'a.ipynb'
    });
  });

  it('shows a path without a file name whole rather than as nothing', () => {
    const folder = portsRefusal({
      holder_kernel_id: 'k-a',
      holder_notebook_path: 'work/'
    });
    expect(portsHolder(folder, 'k-b')).toMatchObject({ owner: 'work/' });
  });

  it('says the ports are held outside the server when no kernel of it holds them', () => {
    // A restore of the snapshot from the command line, say: nobody here to shut down.
    expect(portsHolder(portsRefusal({ holder_kernel_id: null }), 'k-b')).toEqual({
      kind: 'outside'
    });
    expect(portsHolder(portsRefusal(undefined), 'k-b')).toEqual({ kind: 'outside' });
  });

  it('offers no port remedy for other errors, whatever their text', () => {
    const text = { step: 'preflight', cause: 'shell port 5 in use', message: 'x' };
    expect(portsHolder({ ...text, code: 'failed' }, 'k')).toBeNull();
    expect(portsHolder(text, 'k')).toBeNull(); // an older server without codes
    expect(portsHolder(null, 'k')).toBeNull();
  });
});
