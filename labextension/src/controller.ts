/**
 * What the UI knows about each kernel's snapshots, and the save and restore actions.
 *
 * The toolbar button, the status bar item and the commands all read the same state from
 * here, so a snapshot started from one of them shows in all.
 */
import { Notification, showErrorMessage } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { ServiceManager } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import {
  IJob,
  IJobError,
  IKernelStatus,
  IRestoreResult,
  ISnapshotSummary,
  SnapshotAPI
} from './api';
import {
  describeProgress,
  describeSaved,
  formatBytes,
  formatSeconds,
  jobFraction
} from './format';
import { JobFollower } from './jobs';

/** The step and the cause (toasts cut long text; the log path is in the details). */
function shortError(error: IJobError | null): string {
  if (!error) {
    return 'the job ended without a result';
  }
  if (!error.step || !error.cause) {
    return error.message;
  }
  return `${error.step} failed: ${error.cause}` + (error.hint ? `. ${error.hint}` : '');
}

/** A "Details" button showing the whole message, the hint and the kept log. */
function detailsAction(title: string, error: IJobError | null): Notification.IAction[] {
  if (!error) {
    return [];
  }
  const lines = [error.message];
  if (error.log && !error.message.includes(error.log)) {
    lines.push(`Log: ${error.log}`);
  }
  return [
    {
      label: 'Details',
      caption: 'Show the whole error and where its log is',
      callback: () => void showErrorMessage(title, lines.join('\n'))
    }
  ];
}

export const SNAPSHOT_KERNEL_NAME = 'python3-snapshot';
export const SNAPSHOT_KERNEL_DISPLAY_NAME = 'Python 3 (snapshots)';

interface IKernelEntry {
  status: IKernelStatus | null;
  error: string | null;
  job: IJob | null;
}

export interface IAvailability {
  enabled: boolean;
  /** Why the action is (not) available, for tooltips. */
  reason: string;
}

export class SnapshotController {
  constructor(
    readonly api: SnapshotAPI,
    private readonly _services: ServiceManager.IManager
  ) {
    this._follower = new JobFollower(api, _services.events ?? null);
    // A job started elsewhere (the magic, the widget, another browser) still shows here.
    this._follower.jobEvent = job => this._onForeignJob(job);
  }

  /** Emitted with the kernel id whose state changed. */
  get changed(): ISignal<this, string> {
    return this._changed;
  }

  kernelId(panel: NotebookPanel | null): string | null {
    return panel?.sessionContext.session?.kernel?.id ?? null;
  }

  entry(kernelId: string | null): IKernelEntry | null {
    return kernelId ? (this._entries.get(kernelId) ?? null) : null;
  }

  /** Ask the server again whether this kernel can be snapshotted. */
  refresh(kernelId: string): Promise<void> {
    // Several widgets watch the same kernel: one request at a time, plus one more when
    // asked again meanwhile (the state may have changed since the first was sent).
    const running = this._refreshing.get(kernelId);
    if (running) {
      this._refreshAgain.add(kernelId);
      return running;
    }
    const next = this._fetchStatus(kernelId).finally(() => {
      this._refreshing.delete(kernelId);
      if (this._refreshAgain.delete(kernelId)) {
        void this.refresh(kernelId);
      }
    });
    this._refreshing.set(kernelId, next);
    return next;
  }

  private async _fetchStatus(kernelId: string): Promise<void> {
    const entry = this._entry(kernelId);
    try {
      const status = await this.api.kernelStatus(kernelId);
      entry.status = status;
      entry.error = null;
      if (status.job?.status === 'running' && !this._followed.has(status.job.id)) {
        void this._followQuietly(kernelId, status.job);
      }
    } catch (error) {
      entry.status = null;
      entry.error = (error as Error).message;
    }
    this._changed.emit(kernelId);
  }

  /** The save or restore job running for this notebook, if any. */
  activeJob(panel: NotebookPanel | null): IJob | null {
    if (!panel) {
      return null;
    }
    const restoring = this._restores.get(panel.context.path);
    if (restoring) {
      return restoring;
    }
    const job = this.entry(this.kernelId(panel))?.job;
    return job?.status === 'running' ? job : null;
  }

  saveAvailability(panel: NotebookPanel | null): IAvailability {
    const kernelId = this.kernelId(panel);
    if (!kernelId) {
      return { enabled: false, reason: 'No kernel is running in this notebook' };
    }
    const entry = this.entry(kernelId);
    const job = this.activeJob(panel);
    if (job) {
      const what = job.kind === 'save' ? 'A snapshot' : 'A restore';
      return {
        enabled: false,
        reason: `${what} of this kernel is running: ${describeProgress(job)}`
      };
    }
    if (entry?.error) {
      return {
        enabled: false,
        reason: `Cannot snapshot: the server did not answer (${entry.error})`
      };
    }
    if (!entry?.status) {
      return {
        enabled: false,
        reason: 'Checking whether this kernel can be snapshotted…'
      };
    }
    if (!entry.status.ready) {
      const details = entry.status.reasons.join('; ');
      if (entry.status.kernel_name !== SNAPSHOT_KERNEL_NAME) {
        // The usual case: say what to do first, the server's findings after.
        return {
          enabled: false,
          reason:
            `Snapshots unavailable: kernel not started with the '${SNAPSHOT_KERNEL_DISPLAY_NAME}' ` +
            'kernel; switch with Kernel › Change Kernel…' +
            (details ? `\n(${details})` : '')
        };
      }
      return {
        enabled: false,
        reason: `Snapshots unavailable: ${details || 'the server says this kernel is not snapshot-ready'}`
      };
    }
    return {
      enabled: true,
      reason:
        "Snapshot kernel: save this kernel's memory (variables, GPU tensors) to disk"
    };
  }

  /** Snapshot the notebook's kernel, with a notification that follows the job. */
  async save(panel: NotebookPanel): Promise<ISnapshotSummary | null> {
    const kernelId = this.kernelId(panel);
    const availability = this.saveAvailability(panel);
    if (!kernelId || !availability.enabled) {
      Notification.warning(availability.reason, { autoClose: 5000 });
      return null;
    }
    const notebook = panel.context.localPath;
    const id = Notification.emit(`Snapshot of ${notebook}: starting…`, 'in-progress', {
      autoClose: false
    });
    let job: IJob;
    try {
      job = await this.api.startSave(kernelId);
    } catch (error) {
      Notification.update({
        id,
        type: 'error',
        message: `Snapshot failed: ${(error as Error).message}`,
        autoClose: false
      });
      void this.refresh(kernelId);
      return null;
    }
    const final = await this._follow(kernelId, job, current =>
      Notification.update({
        id,
        type: 'in-progress',
        message: `Snapshot of ${notebook}: ${describeProgress(current)}`,
        progress: jobFraction(current),
        autoClose: false
      })
    );
    void this.refresh(kernelId);
    if (final.status === 'succeeded' && final.result) {
      const summary = final.result as ISnapshotSummary;
      Notification.update({
        id,
        type: 'success',
        message: describeSaved(summary),
        progress: undefined,
        autoClose: 8000
      });
      return summary;
    }
    Notification.update({
      id,
      type: 'error',
      message: `Snapshot failed: ${shortError(final.error)}`,
      progress: undefined,
      autoClose: false,
      actions: detailsAction('Snapshot failed', final.error)
    });
    return null;
  }

  /**
   * Restore a snapshot into this notebook: the server starts the restored kernel and
   * the notebook's session is switched to it.
   */
  async restore(panel: NotebookPanel, snapshot: ISnapshotSummary): Promise<boolean> {
    const sessionContext = panel.sessionContext;
    const id = Notification.emit(`Restoring '${snapshot.name}'…`, 'in-progress', {
      autoClose: false
    });
    const fail = (message: string, error: IJobError | null = null): boolean => {
      const actions = detailsAction(`Restore of '${snapshot.name}' failed`, error);
      // A restored kernel listens on the ports of the kernel that was saved: going back
      // to an earlier snapshot of the kernel still running here needs that one gone.
      if (
        error?.step === 'preflight' &&
        / in use$/.test(error.cause) &&
        sessionContext.session?.kernel
      ) {
        message = "its ports are taken, most likely by this notebook's kernel";
        actions.unshift({
          label: 'Shut down kernel, restore',
          caption: "Shut down the notebook's kernel (its current state is lost), then restore",
          displayType: 'accent',
          callback: () => void this._restoreReplacing(panel, snapshot)
        });
      }
      Notification.update({
        id,
        type: 'error',
        message: `Restore of '${snapshot.name}' failed: ${message}`,
        progress: undefined,
        autoClose: false,
        actions
      });
      return false;
    };
    const started = Date.now();
    let job: IJob;
    try {
      // With a session, the server moves it to the restored kernel. Without one, the
      // notebook makes its own session below: JupyterLab cannot adopt a session that the
      // server would create for the path, and a second one for the same path would follow.
      const sessionId = sessionContext.session?.id;
      job = await this.api.startRestore(
        snapshot.id,
        sessionId ? { path: sessionContext.path, session_id: sessionId } : {}
      );
    } catch (error) {
      return fail((error as Error).message);
    }
    const path = panel.context.path;
    const final = await this._follow(null, job, current => {
      this._restores.set(path, current);
      this._changed.emit('');
      Notification.update({
        id,
        type: 'in-progress',
        message: `Restoring '${snapshot.name}': ${describeProgress(current)}`,
        progress: jobFraction(current),
        autoClose: false
      });
    });
    this._restores.delete(path);
    this._changed.emit('');
    if (final.status !== 'succeeded' || !final.result) {
      return fail(shortError(final.error), final.error);
    }
    const result = final.result as IRestoreResult;
    try {
      await this._attach(panel, result);
    } catch (error) {
      return fail(
        `the kernel was restored (id ${result.kernel_id}) but the notebook could not ` +
          `switch to it: ${(error as Error).message}`
      );
    }
    void this.refresh(result.kernel_id);
    const seconds = (Date.now() - started) / 1000;
    Notification.update({
      id,
      type: 'success',
      message:
        `Kernel restored from '${snapshot.name}' (${formatBytes(snapshot.size_bytes)}) ` +
        `in ${formatSeconds(seconds)}`,
      progress: undefined,
      autoClose: 8000
    });
    return true;
  }

  private async _restoreReplacing(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary
  ): Promise<void> {
    if (!panel.isDisposed) {
      await panel.sessionContext.shutdown();
      await this.restore(panel, snapshot);
    }
  }

  /** Make the notebook's session use the restored kernel, unless the server already did. */
  private async _attach(panel: NotebookPanel, result: IRestoreResult): Promise<void> {
    const sessionContext = panel.sessionContext;
    const current = () => sessionContext.session?.kernel?.id ?? null;
    if (current() === result.kernel_id) {
      return;
    }
    // When the server moved the session, the session list carries the new kernel.
    await this._services.sessions.refreshRunning();
    if (current() === result.kernel_id) {
      return;
    }
    await sessionContext.changeKernel({ id: result.kernel_id });
    if (current() !== result.kernel_id) {
      throw new Error(`the session still uses kernel ${current() ?? 'none'}`);
    }
  }

  private async _follow(
    kernelId: string | null,
    job: IJob,
    onChange: (job: IJob) => void
  ): Promise<IJob> {
    const track = (current: IJob) => {
      if (kernelId) {
        this._entry(kernelId).job = current;
        this._changed.emit(kernelId);
      }
      onChange(current);
    };
    this._followed.add(job.id);
    let final: IJob;
    try {
      final = await this._follower.follow(job, track);
    } catch (error) {
      final = {
        ...job,
        status: 'failed',
        error: {
          step: job.phase,
          cause: (error as Error).message,
          message: `lost track of the job: ${(error as Error).message}`
        }
      };
    }
    this._followed.delete(job.id);
    if (kernelId) {
      this._entry(kernelId).job = null;
      this._changed.emit(kernelId);
    }
    return final;
  }

  private async _followQuietly(kernelId: string, job: IJob): Promise<void> {
    await this._follow(kernelId, job, () => undefined);
    await this.refresh(kernelId);
  }

  private _onForeignJob(job: IJob): void {
    if (
      job.kind === 'restore' &&
      job.status === 'succeeded' &&
      (job.result as IRestoreResult | null)?.session_id &&
      !this._followed.has(job.id)
    ) {
      // Restored elsewhere (%gpu_snapshot restore, a script) into a session that may be a
      // notebook open here: pick up its new kernel now, not at the next session poll.
      void this._services.sessions.refreshRunning();
      return;
    }
    const kernelId = job.kernel_id;
    if (!kernelId || !this._entries.has(kernelId) || this._followed.has(job.id)) {
      return;
    }
    if (job.status === 'running') {
      void this._followQuietly(kernelId, job);
    }
  }

  private _entry(kernelId: string): IKernelEntry {
    let entry = this._entries.get(kernelId);
    if (!entry) {
      entry = { status: null, error: null, job: null };
      this._entries.set(kernelId, entry);
    }
    return entry;
  }

  dispose(): void {
    this._follower.dispose();
  }

  private _entries = new Map<string, IKernelEntry>();
  private _restores = new Map<string, IJob>();
  private _followed = new Set<string>();
  private _refreshing = new Map<string, Promise<void>>();
  private _refreshAgain = new Set<string>();
  private _changed = new Signal<this, string>(this);
  private _follower: JobFollower;
}
