/**
 * The notification of a save or a restore, on JupyterLab's own notification manager: the
 * progress changes the toast in place, the outcome is a new toast and the old one goes.
 */
import { Notification } from '@jupyterlab/apputils';
import { JobNotification } from '../src/progress';

// JupyterLab's real notification manager, without the rest of apputils (widgets, dialogs)
// that would take jest most of a minute to load.
jest.mock('@jupyterlab/apputils', () => ({
  Notification: jest.requireActual('@jupyterlab/apputils/lib/notification').Notification
}));

/** The notifications on screen (JupyterLab's manager, which the toasts display). */
function shown(): {
  id: string;
  message: string;
  type: string;
  autoClose: number | false;
}[] {
  return Notification.manager.notifications.map(n => ({
    id: n.id,
    message: n.message,
    type: n.type,
    autoClose: n.options.autoClose ?? 5000
  }));
}

// Toasts are taken as on screen unless a test says otherwise.
let onScreen = true;
JobNotification.isShown = () => onScreen;
JobNotification.settleMs = 0;

afterEach(() => {
  Notification.dismiss();
  onScreen = true;
});

describe('JobNotification', () => {
  it('starts as one in-progress notification that does not close by itself', () => {
    new JobNotification('Snapshot of a.ipynb: starting…');
    expect(shown()).toEqual([
      expect.objectContaining({
        message: 'Snapshot of a.ipynb: starting…',
        type: 'in-progress',
        autoClose: false
      })
    ]);
  });

  it('changes that notification in place with the progress', () => {
    const toast = new JobNotification('starting…');
    const [started] = shown();
    toast.progress('writing memory: 1.0 MiB of 4.0 MiB', 0.25);
    const now = Notification.manager.notifications;
    expect(now).toHaveLength(1);
    expect(now[0].id).toBe(started.id);
    expect(now[0].message).toBe('writing memory: 1.0 MiB of 4.0 MiB');
    expect(now[0].type).toBe('in-progress');
    expect(now[0].options.progress).toBe(0.25);
    expect(now[0].options.autoClose).toBe(false);
  });

  it('shows the outcome as a new notification and dismisses the progress one', () => {
    const toast = new JobNotification('starting…');
    toast.progress('committing…', 0.99);
    const [progress] = shown();
    toast.finish('success', "Snapshot saved: 'x', 512 B", { autoClose: 6000 });
    const after = shown();
    expect(after).toHaveLength(1);
    expect(after[0].id).not.toBe(progress.id);
    expect(after[0]).toMatchObject({
      message: "Snapshot saved: 'x', 512 B",
      type: 'success',
      autoClose: 6000
    });
  });

  it('gives a failure its actions, whose dismiss closes the outcome', () => {
    const toast = new JobNotification('starting…');
    const callback = jest.fn();
    let dismissOutcome: (() => void) | null = null;
    toast.finish('error', 'Snapshot failed: dump failed: no space left', {
      autoClose: false,
      actions: dismiss => {
        dismissOutcome = dismiss;
        return [{ label: 'Details', callback }];
      }
    });
    const [outcome] = Notification.manager.notifications;
    expect(outcome.type).toBe('error');
    expect(outcome.options.autoClose).toBe(false);
    expect(outcome.options.actions?.map(a => a.label)).toEqual(['Details']);

    dismissOutcome!();
    expect(shown()).toEqual([]);
  });

  it('leaves other notifications alone', () => {
    const other = Notification.info('Kernel restarted');
    const toast = new JobNotification('starting…');
    toast.finish('error', 'failed', { autoClose: false });
    expect(shown().map(n => n.id)).toContain(other);
    expect(shown()).toHaveLength(2);
  });

  it('sends no progress before its toast is on screen, so none brings it back later', () => {
    onScreen = false;
    const toast = new JobNotification('Restoring x…');
    toast.progress('Restoring x: checking…', 0);
    expect(shown()).toEqual([expect.objectContaining({ message: 'Restoring x…' })]);
    onScreen = true;
    toast.progress('Restoring x: restoring…', 0.5);
    expect(shown()).toEqual([
      expect.objectContaining({ message: 'Restoring x: restoring…' })
    ]);
  });

  it('dismisses the progress toast a moment after the outcome, once its updates are applied', () => {
    jest.useFakeTimers();
    JobNotification.settleMs = 300;
    try {
      const toast = new JobNotification('Restoring x…');
      toast.progress('Restoring x: checking…', 0);
      toast.finish('error', 'Restore of x failed', { autoClose: false });
      expect(shown().map(n => n.message)).toEqual([
        'Restore of x failed',
        'Restoring x: checking…'
      ]);
      jest.advanceTimersByTime(300);
      expect(shown().map(n => n.message)).toEqual(['Restore of x failed']);
    } finally {
      JobNotification.settleMs = 0;
      jest.useRealTimers();
    }
  });
});
