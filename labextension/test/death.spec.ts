/**
 * The notice of a kernel death: its words (from the server's codes, never its English),
 * and the notification it leaves on JupyterLab's real notification manager, with Restore
 * and Dismiss. The controller, the server's API and the notebook panel are stand-ins.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import { Signal } from '@lumino/signaling';
import type { IKernelDeath, IKernelStatus } from '../src/api';
import type { SnapshotController } from '../src/controller';
import { DEATH_EVENT_PREFIX, DeathNotice, describeDeath } from '../src/death';
import { EventStream, ShoutingBundle, makeSnapshot, makeStatus } from './fixtures';
import { click, shown } from './notifications';

jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification
}));

const NOW = 1_000_000;

function makeDeath(fields: Partial<IKernelDeath> = {}): IKernelDeath {
  return {
    at: NOW - 30,
    code: 'signal',
    cause: 'killed by signal 11 (SIGSEGV)',
    signal: 11,
    signal_name: 'SIGSEGV',
    exit_status: null,
    restarted: true,
    notebook_path: 'work/train.ipynb',
    snapshot: { id: 's-1', name: 'before-crash', created: NOW - 180 },
    ...fields
  };
}

describe('describeDeath', () => {
  it('says what killed the kernel, that its state is gone, and which snapshot brings it back', () => {
    expect(describeDeath(makeDeath(), NOW)).toBe(
      "The kernel died (killed by signal 11, SIGSEGV) and was restarted without its state. Its newest snapshot 'before-crash', from 3 min ago, can bring it back."
    );
  });

  it('says that there is no snapshot to restore', () => {
    expect(describeDeath(makeDeath({ snapshot: null }), NOW)).toBe(
      'The kernel died (killed by signal 11, SIGSEGV) and was restarted without its state. There is no snapshot of it to restore.'
    );
  });

  it('reads the codes, not the English cause', () => {
    const exited = makeDeath({
      code: 'exit',
      cause: 'anything at all',
      signal: null,
      signal_name: null,
      exit_status: 1,
      snapshot: null
    });
    expect(describeDeath(exited, NOW)).toMatch(
      /^The kernel died \(exited with status 1\)/
    );
    const unnamed = makeDeath({ signal: 64, signal_name: null, cause: null });
    expect(describeDeath(unnamed, NOW)).toMatch(
      /^The kernel died \(killed by signal 64\)/
    );
    const unknown = makeDeath({ code: 'unknown', signal: null, signal_name: null });
    expect(describeDeath(unknown, NOW)).toMatch(/^The kernel died \(cause unknown\)/);
  });

  it('says so when the server could not restart the kernel', () => {
    expect(describeDeath(makeDeath({ restarted: false, snapshot: null }), NOW)).toBe(
      'The kernel died (killed by signal 11, SIGSEGV) and could not be restarted: its state is gone. There is no snapshot of it to restore.'
    );
  });

  it('goes through the translation bundle', () => {
    const trans = new ShoutingBundle();
    expect(describeDeath(makeDeath(), NOW, trans)).toBe(
      "THE KERNEL DIED (KILLED BY SIGNAL 11, SIGSEGV) AND WAS RESTARTED WITHOUT ITS STATE. ITS NEWEST SNAPSHOT 'before-crash', FROM 3 MIN AGO, CAN BRING IT BACK."
    );
  });
});

/** The controller as the notice reads it: each kernel's status, and its changed signal. */
function setUp(death: IKernelDeath | null, events?: EventStream) {
  const statuses = new Map<string, IKernelStatus>();
  const setDeath = (value: IKernelDeath | null) =>
    statuses.set('k-1', makeStatus({ kernel_id: 'k-1', death: value }));
  setDeath(death);
  const summary = makeSnapshot({ id: 's-1', name: 'before-crash' });
  const changed = new Signal<unknown, string>({});
  const controller = {
    changed,
    entry: jest.fn((kernelId: string) => {
      const status = statuses.get(kernelId);
      return status ? { status, error: null, job: null, autosave: null } : null;
    }),
    refresh: jest.fn(async () => undefined),
    restore: jest.fn(async () => true),
    api: {
      getSnapshot: jest.fn(async () => summary),
      dismissDeath: jest.fn(async () => undefined)
    }
  };
  const panel = {
    context: { path: 'work/train.ipynb', localPath: 'work/train.ipynb' },
    isDisposed: false
  } as unknown as NotebookPanel;
  const notice = new DeathNotice(
    controller as unknown as SnapshotController,
    kernelId => (kernelId === 'k-1' ? panel : null),
    events?.manager ?? null
  );
  return { controller, panel, notice, summary, setDeath, changed };
}

const settle = () => new Promise(resolve => setTimeout(resolve, 0));

afterEach(() => {
  Notification.dismiss();
});

describe('DeathNotice', () => {
  it('shows a death once, until dismissed, with Restore and Dismiss', () => {
    const { changed, notice } = setUp(
      makeDeath({
        snapshot: { id: 's-1', name: 'before-crash', created: Date.now() / 1000 - 180 }
      })
    );
    changed.emit('k-1');
    changed.emit('k-1'); // polled again: the same death
    expect(shown()).toEqual([
      {
        message:
          "train.ipynb: The kernel died (killed by signal 11, SIGSEGV) and was restarted without its state. Its newest snapshot 'before-crash', from 3 min ago, can bring it back.",
        type: 'error',
        autoClose: false,
        actions: ['Restore', 'Dismiss']
      }
    ]);
    notice.dispose();
  });

  it('offers only Dismiss when there is no snapshot', () => {
    const { changed, notice } = setUp(makeDeath({ snapshot: null }));
    changed.emit('k-1');
    expect(shown()).toHaveLength(1);
    expect(shown()[0].message).toContain('There is no snapshot of it to restore.');
    expect(shown()[0].actions).toEqual(['Dismiss']);
    notice.dispose();
  });

  it('shows nothing for a kernel that did not die, nor for one no notebook here runs', () => {
    const { changed, notice } = setUp(null);
    changed.emit('k-1');
    changed.emit('k-other');
    changed.emit('');
    expect(shown()).toEqual([]);
    notice.dispose();
  });

  it("Restore restores the death's snapshot, replacing the blank kernel, then forgets the death", async () => {
    const { changed, controller, panel, summary, notice } = setUp(makeDeath());
    changed.emit('k-1');
    click('Restore');
    await settle();
    expect(controller.api.getSnapshot).toHaveBeenCalledWith('s-1');
    expect(controller.restore).toHaveBeenCalledWith(panel, summary, {
      replaceOwnKernel: true
    });
    expect(controller.api.dismissDeath).toHaveBeenCalledWith('k-1');
    expect(shown()).toEqual([]);
    notice.dispose();
  });

  it('Dismiss tells the server and asks for the status again', async () => {
    const { changed, controller, notice, setDeath } = setUp(makeDeath());
    changed.emit('k-1');
    click('Dismiss');
    await settle();
    expect(controller.api.dismissDeath).toHaveBeenCalledWith('k-1');
    expect(controller.refresh).toHaveBeenCalledWith('k-1');
    expect(controller.restore).not.toHaveBeenCalled();
    expect(shown()).toEqual([]);
    // A later death of the same slot shows again.
    setDeath(makeDeath({ at: NOW + 600 }));
    changed.emit('k-1');
    expect(shown()).toHaveLength(1);
    notice.dispose();
  });

  it('closes the notification when the death was dismissed elsewhere', () => {
    const { changed, notice, setDeath } = setUp(makeDeath());
    changed.emit('k-1');
    expect(shown()).toHaveLength(1);
    setDeath(null);
    changed.emit('k-1');
    expect(shown()).toEqual([]);
    notice.dispose();
  });

  it("asks for a kernel's status at once when the server reports its death", () => {
    const events = new EventStream();
    const { controller, notice } = setUp(null, events);
    const emit = (kernelId: string, schema = `${DEATH_EVENT_PREFIX}v1`) =>
      events.signal.emit({ schema_id: schema, kernel_id: kernelId } as never);
    emit('k-other');
    emit('k-1', 'https://events.jupyter.org/jupyter_gpu_snapshot/job/v1');
    expect(controller.refresh).not.toHaveBeenCalled();
    emit('k-1');
    expect(controller.refresh).toHaveBeenCalledWith('k-1');
    notice.dispose();
  });
});
