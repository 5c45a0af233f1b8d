/**
 * When a notebook's snapshot-ready kernel dies, the server's restarter puts a blank kernel
 * in its slot and JupyterLab shows nothing but a fresh kernel. The server records the death
 * (openapi.yaml, KernelDeath) in the kernel's status; this turns it into a notification
 * that stays until dismissed: what killed the kernel, that its state is gone, and the
 * newest snapshot that brings it back, with Restore and Dismiss.
 */
import { Notification } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { Event } from '@jupyterlab/services';
import type { TranslationBundle } from '@jupyterlab/translation';
import type { IKernelDeath } from './api';
import type { SnapshotController } from './controller';
import { formatAge } from './format';
import { untranslated } from './translation';

/** The server's kernel-death event (server/event_schemas/kernel-death-v1.yaml). */
export const DEATH_EVENT_PREFIX =
  'https://events.jupyter.org/jupyter_gpu_snapshot/kernel-death/';

/** 'killed by signal 11, SIGSEGV', from the death's codes (the kernel's panel says the same). */
export function describeCause(death: IKernelDeath, trans = untranslated): string {
  if (death.code === 'signal' && death.signal !== null) {
    return death.signal_name
      ? trans.__('killed by signal %1, %2', death.signal, death.signal_name)
      : trans.__('killed by signal %1', death.signal);
  }
  if (death.code === 'exit' && death.exit_status !== null) {
    return trans.__('exited with status %1', death.exit_status);
  }
  return trans.__('cause unknown');
}

/** The notification's text: the death, the lost state, and the snapshot (or that there is none). */
export function describeDeath(
  death: IKernelDeath,
  now = Date.now() / 1000,
  trans = untranslated
): string {
  const cause = describeCause(death, trans);
  const died = death.restarted
    ? trans.__('The kernel died (%1) and was restarted without its state.', cause)
    : trans.__(
        'The kernel died (%1) and could not be restarted: its state is gone.',
        cause
      );
  if (!death.snapshot) {
    return trans.__('%1 There is no snapshot of it to restore.', died);
  }
  return trans.__(
    "%1 Its newest snapshot '%2', from %3, can bring it back.",
    died,
    death.snapshot.name,
    formatAge(death.snapshot.created, now, trans)
  );
}

export class DeathNotice {
  /**
   * ``panelOf`` finds the open notebook whose session runs a kernel; ``events`` is the
   * server's event stream, which makes a death show at once instead of at the next poll.
   */
  constructor(
    private readonly _controller: SnapshotController,
    private readonly _panelOf: (kernelId: string) => NotebookPanel | null,
    private readonly _events: Event.IManager | null = null,
    private readonly _trans: TranslationBundle = untranslated
  ) {
    _controller.changed.connect(this._onChanged, this);
    _events?.stream.connect(this._onEvent, this);
  }

  dispose(): void {
    this._controller.changed.disconnect(this._onChanged, this);
    this._events?.stream.disconnect(this._onEvent, this);
  }

  private _onEvent(_: unknown, event: Event.Emission): void {
    if (!event.schema_id?.startsWith(DEATH_EVENT_PREFIX)) {
      return;
    }
    const kernelId = (event as unknown as { kernel_id?: unknown }).kernel_id;
    if (typeof kernelId === 'string' && this._panelOf(kernelId)) {
      void this._controller.refresh(kernelId);
    }
  }

  private _onChanged(_: unknown, kernelId: string): void {
    if (!kernelId) {
      return;
    }
    const death = this._controller.entry(kernelId)?.status?.death ?? null;
    const shown = this._shown.get(kernelId);
    if (!death) {
      if (shown && this._controller.entry(kernelId)?.status) {
        // Dismissed elsewhere (the kernel's panel, another tab): gone here too.
        this._shown.delete(kernelId);
        Notification.dismiss(shown.toast);
      }
      return;
    }
    if (shown?.at === death.at) {
      return;
    }
    const panel = this._panelOf(kernelId);
    if (!panel) {
      return;
    }
    if (shown) {
      Notification.dismiss(shown.toast);
    }
    this._shown.set(kernelId, {
      at: death.at,
      toast: this._show(kernelId, death, panel)
    });
  }

  private _show(kernelId: string, death: IKernelDeath, panel: NotebookPanel): string {
    const trans = this._trans;
    const notebook = panel.context.localPath.split('/').pop() || panel.context.localPath;
    const message = trans.__('%1: %2', notebook, describeDeath(death, undefined, trans));
    const actions: Notification.IAction[] = [];
    const snapshot = death.snapshot;
    if (snapshot) {
      actions.push({
        label: trans.__('Restore'),
        caption: trans.__(
          "Restore '%1' and switch %2 to it (its new, blank kernel is shut down)",
          snapshot.name,
          notebook
        ),
        displayType: 'accent',
        callback: () => void this._restore(kernelId, snapshot.id, panel)
      });
    }
    actions.push({
      label: trans.__('Dismiss'),
      caption: trans.__('Hide this notice; the snapshots stay'),
      callback: () => void this._dismiss(kernelId)
    });
    return Notification.error(message, { autoClose: false, actions });
  }

  private async _restore(
    kernelId: string,
    snapshotId: string,
    panel: NotebookPanel
  ): Promise<void> {
    const trans = this._trans;
    let summary;
    try {
      summary = await this._controller.api.getSnapshot(snapshotId);
    } catch (error) {
      Notification.error(trans.__('Cannot restore: %1', (error as Error).message), {
        autoClose: false
      });
      return;
    }
    if (panel.isDisposed) {
      return;
    }
    this._close(kernelId);
    // The blank kernel that replaced the dead one holds its ports and nothing worth keeping.
    if (await this._controller.restore(panel, summary, { replaceOwnKernel: true })) {
      // The slot is shut down by now; a server that still knows it forgets the death.
      await this._controller.api.dismissDeath(kernelId).catch(() => undefined);
    }
  }

  /** Close the kernel's notification (JupyterLab closes a clicked one on screen only). */
  private _close(kernelId: string): void {
    const shown = this._shown.get(kernelId);
    this._shown.delete(kernelId);
    if (shown) {
      Notification.dismiss(shown.toast);
    }
  }

  private async _dismiss(kernelId: string): Promise<void> {
    this._close(kernelId);
    try {
      await this._controller.api.dismissDeath(kernelId);
    } catch (error) {
      Notification.warning(
        this._trans.__('The notice could not be dismissed: %1', (error as Error).message),
        { autoClose: 8000 }
      );
    }
    await this._controller.refresh(kernelId);
  }

  private _shown = new Map<string, { at: number; toast: string }>();
}
